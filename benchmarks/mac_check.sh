#!/usr/bin/env bash
# The Mac run: on Apple silicon (MLX on Metal), write the Metal results to commit.
#   bash benchmarks/mac_check.sh            (from the repository root, after `make test` has made .venv)
# Writes benchmarks/results/:
#   gpu-tests-metal/gpu-*.log        the GPU test files (kernels against their emulations, caches through mlx-lm)
#   doctor-metal.json                backend, versions, each kernel's self-check
#   decode_attention-metal.json      decode attention per implementation at 4K/16K/32K
#   model_decode-metal.json          whole-model decode and prefill (Llama-3-8B shapes, 4-bit random weights)
# Sizes fit a 16 GB Mac (4-bit weights: about 5 GB); set CONTEXTS="4096,16384,65536" on a larger one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ "$(uname -s)" = Darwin ] || { echo "mac_check.sh: run this on a Mac (MLX on Metal); here: $(uname -s)" >&2; exit 2; }
"$PY" -c "import mlx.core as mx; import sys; sys.exit(0 if mx.metal.is_available() else 1)" \
  || { echo "mac_check.sh: MLX does not see a Metal GPU" >&2; exit 2; }
out=benchmarks/results
mkdir -p "$out"
"$PY" -m gmlx_lab.cli doctor --json > "$out/doctor-metal.json" || echo "doctor: a kernel failed its self-check (see the JSON)"
PATH="$(dirname "$PY"):$PATH" bash benchmarks/gpu_check.sh "$out/gpu-tests-metal" || echo "gpu_check: failures (see the logs)"
"$PY" benchmarks/decode_attention.py --contexts 4096 16384 32768 --out "$out/decode_attention-metal.json"
"$PY" benchmarks/model_decode.py --shape llama3-8b --weights 4 --contexts "${CONTEXTS:-4096,16384}" --decode 64 \
  --out "$out/model_decode-metal.json"
echo "wrote $out/*-metal.json and $out/gpu-tests-metal/: commit them with the Mac's name in the message"
