#!/usr/bin/env bash
# The GPU test files, one log each (failures in full), on a machine where MLX runs on a GPU backend.
# Usage: bash benchmarks/gpu_check.sh OUTDIR [SECONDS_PER_FILE]   (logs: OUTDIR/gpu-<file>.log)
set -u
out=${1:?usage: gpu_check.sh OUTDIR [SECONDS_PER_FILE]}
limit=${2:-300}
mkdir -p "$out"
python -c "from gmlx_lab.kernels import active_backend as b; import sys; sys.exit(b() == 'cpu')" \
  || { echo "gpu_check.sh: MLX runs on the CPU here; these logs must come from a GPU backend" >&2; exit 2; }
status=0
for f in test_kernels test_selfcheck test_kvarn_cache test_affine_fp16 test_attention test_mlx_lm_dropin test_window; do
  timeout "$limit" python -m pytest "tests/$f.py" -rfEs -p no:cacheprovider --tb=short >"$out/gpu-$f.log" 2>&1
  rc=$?
  echo "$f: exit $rc  $(tail -1 "$out/gpu-$f.log")"
  [ $rc -eq 0 ] || status=1
done
exit $status
