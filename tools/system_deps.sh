#!/usr/bin/env bash
# Debian packages the tests need: chromium (the real-browser notebook test),
# OpenBLAS (MLX's CPU wheel ships a slow reference BLAS; preloading OpenBLAS makes
# float32 matmuls several times faster) and g++ (runs the CUDA kernel sources on CPU
# threads). Installs only what is missing; needs root or sudo.
set -euo pipefail
if [ "$(uname -s)" != Linux ]; then
  # macOS: MLX uses Metal and Accelerate; the browser test finds a Chromium-family browser through
  # GMLX_CHROMIUM (e.g. "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome").
  [ -n "${GMLX_CHROMIUM:-}" ] || echo "system_deps: set GMLX_CHROMIUM to a Chromium or Chrome binary for the browser test"
  exit 0
fi
need=()
[ -x "${GMLX_CHROMIUM:-/usr/bin/chromium}" ] || need+=(chromium)
[ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] || [ "$(uname -m)" != x86_64 ] || need+=(libopenblas0-pthread)
command -v g++ >/dev/null 2>&1 || need+=(g++)
[ ${#need[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system_deps: missing ${need[*]} and no apt-get here; install them with your package manager" >&2
  exit 1
fi
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "system_deps: installing ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
