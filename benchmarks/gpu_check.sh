#!/usr/bin/env bash
# The GPU test files, one log each (failures in full), on a machine where MLX runs on a GPU backend.
# Usage: bash benchmarks/gpu_check.sh OUTDIR [SECONDS_PER_FILE]   (logs: OUTDIR/gpu-<file>.log)
# The files run side by side (each its own process on the one GPU; none times anything), so the wall time is
# about that of the longest file, test_kernels (~155 s on an H200). GPU_CHECK_SERIAL=1 runs them one by one.
# GPU_CHECK_WORKERS=N splits test_kernels (whose tests mostly run kernel sources on CPU threads) over N
# pytest-xdist workers, where pytest-xdist is installed.
set -u
out=${1:?usage: gpu_check.sh OUTDIR [SECONDS_PER_FILE]}
limit=${2:-300}
mkdir -p "$out"
python -c "from gmlx_lab.kernels import active_backend as b; import sys; sys.exit(b() == 'cpu')" \
  || { echo "gpu_check.sh: MLX runs on the CPU here; these logs must come from a GPU backend" >&2; exit 2; }
files="test_kernels test_selfcheck test_precompiled test_kvarn_cache test_affine_fp16 test_attention test_mlx_lm_dropin test_window"
workers=()
if [ "${GPU_CHECK_WORKERS:-0}" -gt 1 ] && python -c "import xdist" 2>/dev/null; then workers=(-n "$GPU_CHECK_WORKERS"); fi
run() {
  extra=()
  [ "$1" = test_kernels ] && extra=("${workers[@]}")
  timeout "$limit" python -m pytest "tests/$1.py" "${extra[@]}" -rfEs -p no:cacheprovider --tb=short \
    >"$out/gpu-$1.log" 2>&1
  echo $? >"$out/.rc-$1"
}
for f in $files; do
  if [ "${GPU_CHECK_SERIAL:-0}" = 1 ]; then run "$f"; else run "$f" & fi
done
wait
status=0
for f in $files; do
  rc=$(cat "$out/.rc-$f"); rm -f "$out/.rc-$f"
  echo "$f: exit $rc  $(tail -1 "$out/gpu-$f.log")"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
