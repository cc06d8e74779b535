#!/usr/bin/env bash
# Debian packages the tests need: chromium (the real-browser notebook test) and
# OpenBLAS (MLX's CPU wheel ships a slow reference BLAS; preloading OpenBLAS makes
# float32 matmuls several times faster). Installs only what is missing; needs root or sudo.
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] || [ "$(uname -m)" != x86_64 ] || need+=(libopenblas0-pthread)
[ ${#need[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system_deps: missing ${need[*]} and no apt-get here; install them with your package manager" >&2
  exit 1
fi
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "system_deps: installing ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
