#!/usr/bin/env bash
# Replays mybinder.org's build of binder/ on this machine and runs every notebook in the result, recording each
# one's peak memory against Binder's 2 GB (tools/binder_memory.py; it fails above 80%, i.e. under 20% spare).
#
#   bash tools/binder_check.sh [WORKDIR]     # default: a fresh temporary folder, removed at the end
#
# repo2docker's steps, in its order, each on a clean copy of the repository's files (tracked and untracked,
# not ignored), as repo2docker copies the repository into the image:
#   1. binder/apt.txt      apt-get install of each package (needs root or sudo)
#   2. binder/runtime.txt  the Python it names ("python-3.11"): python3.11 from PATH, in a new virtualenv with
#                          no system or user site-packages (repo2docker makes a conda environment of that Python)
#   3. binder/requirements.txt  pip install --no-cache-dir -r, from the repository's root
#   4. binder/postBuild    run from the repository's root, that environment first on PATH
#   5. binder/start        wraps the command (there: the notebook server; here: tools/binder_memory.py)
# Differences from mybinder.org, which the report states: this machine's OS (repo2docker's image is Ubuntu),
# a virtualenv rather than conda, and no notebook server process (a few tens of MB there).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-}"
if [ -z "$WORK" ]; then
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
REPO="$WORK/repo"
ENV="$WORK/env"
step() { printf '\n[binder_check] %s\n' "$*"; }

step "a clean copy of the repository in $REPO"
rm -rf "$REPO" "$ENV"
mkdir -p "$REPO"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - 2>/dev/null) | tar -xf - -C "$REPO"

step "apt.txt: $(grep -v '^\s*#' "$REPO/binder/apt.txt" | xargs)"
need=()
while read -r pkg; do
  [ -z "$pkg" ] || [[ "$pkg" == \#* ]] && continue
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done < "$REPO/binder/apt.txt"
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

runtime="$(tr -d '[:space:]' < "$REPO/binder/runtime.txt")"
version="${runtime#python-}"
PY="$(command -v "python$version" || true)"
[ -n "$PY" ] || { echo "binder_check: binder/runtime.txt asks for $runtime; no python$version on PATH" >&2; exit 1; }
step "runtime.txt: $runtime -> $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
"$PY" -m venv "$ENV"
export PATH="$ENV/bin:$PATH" PYTHONNOUSERSITE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH VIRTUAL_ENV_PROMPT
export VIRTUAL_ENV="$ENV"
# A new home, as a new Binder user has: no pip cache, no Jupyter kernelspecs of another Python, and no
# converted models (Gemma 3 270M is converted on first use, in the first notebook that loads it).
export HOME="$WORK/home"
mkdir -p "$HOME"

step "requirements.txt"
(cd "$REPO" && pip install -q --no-cache-dir -r binder/requirements.txt)

step "postBuild"
(cd "$REPO" && bash binder/postBuild)

step "start: every notebook, peak memory of its kernel"
mkdir -p "$ROOT/benchmarks/results"
commit="$(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" status --porcelain | grep -q . && echo ' with uncommitted changes' || true)"
(cd "$REPO" && bash binder/start python tools/binder_memory.py --notebooks notebooks --commit "$commit" \
  --out "$ROOT/benchmarks/results/binder-memory-cpu.json")
