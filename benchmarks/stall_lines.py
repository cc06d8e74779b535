"""Which source lines of kvarn_decode the sampled warps wait on: stall_sample.py's samples per instruction,
mapped to the kernel text's lines through a build of the same text with line info. Runs without a GPU.

Usage (after stall_sample.py wrote its JSON and, with it, the `.pcs.json` files of every sampled instruction):
  python benchmarks/stall_lines.py --stalls benchmarks/results/decode_stalls-h200.json --pcs DIR \\
      --nvrtc .../nvidia/cu13/lib/libnvrtc.so.13 --nvdisasm .../nvidia/cu13/bin/nvdisasm \\
      --cuda-include .../nvidia/cu13/include --cccl .../mlx/include/cccl --mlx-headers DIR

MLX 0.32 compiles a custom kernel with NVRTC without line info and keeps it in memory only (custom kernels do
not go to MLX_PTX_CACHE_DIR), so the profiled binary has no lines. Here the kernel's full text is rebuilt as
MLX 0.32's `build_kernel` writes it (MLX's default header, our header, the signature from the inputs' dtypes,
the template constants read from the kernel's name, our body), compiled by NVRTC (the `nvidia-cuda-nvrtc`
wheel) for sm_90 with -lineinfo, and disassembled with `nvdisasm -gi` (the `nvidia-cuda-nvdisasm` wheel). A sampled
instruction's offset is its address minus the kernel's first address; `sass_match` counts the sampled
instructions whose SASS text equals the rebuilt binary's at that offset (reuse flags and branch targets aside):
all of them means the same code. Each
line row sums its instructions' samples; the reasons come from the instructions stall_sample.py kept with
their reasons (its top 60 per kernel; `reasons_cover` is their share of the kernel's samples).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE.parent)]

MLX_HEADERS = ("atomic_ops.cuh", "binary_ops.cuh", "cast_op.cuh", "config.h", "complex.cuh", "fp16_math.cuh",
               "indexing.cuh", "scatter_ops.cuh", "unary_ops.cuh", "ternary_ops.cuh", "utils.cuh")
TEMPLATE = ("KB", "VB", "S", "NQ", "NCHUNK", "L", "WARPS", "MERGE", "QDT", "RING", "NST", "PROW")
CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "uint32": "uint32_t",
              "int32": "int32_t", "uint8": "uint8_t", "uint16": "uint16_t", "int8": "int8_t"}


def kvarn_signature(bits: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(inputs, outputs) of kvarn_decode as (name, dtype), read from a launch on the CPU that is stopped before
    it runs: the dtypes are those the caches pass."""
    import mlx.core as mx

    from gmlx_lab.cache.buffers import KV
    from gmlx_lab.cache.kvarn.records import KvarnParts, encode_tokens
    from gmlx_lab.kernels import kvarn, splits

    seen: dict[str, Any] = {}

    def stop(name: str, inputs: dict, outputs: dict, **_: Any) -> list:
        seen.update(inputs=[(k, str(a.dtype).removeprefix("mlx.core.")) for k, a in inputs.items()],
                    outputs=[(k, str(dt).removeprefix("mlx.core.")) for k, (_, dt) in outputs.items()])
        raise StopIteration

    x = mx.random.normal((2, 1, 2, 128 + 2 * 128 + 130, 128)).astype(mx.float16)
    k, v = x[0], x[1]
    body = KV(*(encode_tokens(mx.hadamard_transform(t[:, :, 128:384]), bits, kind) for t, kind in ((k, "k"), (v, "v"))))
    parts = KvarnParts(KV(k[:, :, :128], v[:, :, :128]), body, KV(k[:, :, 384:], v[:, :, 384:]), 130)
    qg = splits.group_queries(mx.random.normal((1, 4, 1, 128)).astype(mx.float16), 2)
    original, kvarn.launch = kvarn.launch, stop
    try:
        kvarn.kvarn_partials(qg, 0.09, parts, 1, False, per_warp=1)
    except StopIteration:
        pass
    finally:
        kvarn.launch = original
    return seen["inputs"], seen["outputs"]


def kernel_text(func: str, template: dict[str, int]) -> str:
    """kvarn_decode's full text as MLX 0.32's build_kernel writes it (custom_kernel.cpp)."""
    from gmlx_lab.kernels.sources import assemble, compact

    header, source = (compact(t) for t in assemble("kvarn_decode", "cuda"))
    inputs, outputs = kvarn_signature(template["KB"])
    text = ('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
            "#define inf cuda::std::numeric_limits<float>::infinity()\n\n")
    text += header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    text += f"__global__ void {func}(\n"
    text += "".join(f"    const {CUDA_TYPES[dt]}* {name},\n" for name, dt in inputs)
    text += ",\n".join(f"    {CUDA_TYPES[dt]}* {name}" for name, dt in outputs) + ") {\n"
    text += "".join(f"  constexpr int {k} = {v};\n" for k, v in template.items()) + "\n"
    return text + source + "\n}\n\n} // namespace mlx::core::cu\n"


def compile_lineinfo(text: str, func: str, args: argparse.Namespace) -> bytes:
    """NVRTC's cubin of `text` for sm_90 with -lineinfo (MLX's options otherwise)."""
    nvrtc = ctypes.CDLL(args.nvrtc)
    headers = [(Path(args.mlx_headers) / h).read_bytes() for h in MLX_HEADERS]
    names = [f"mlx/backend/cuda/device/{h}".encode() for h in MLX_HEADERS]
    prog = ctypes.c_void_p()
    nvrtc.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), f"{func}.cu".encode(), len(headers),
                             (ctypes.c_char_p * len(headers))(*headers), (ctypes.c_char_p * len(names))(*names))
    nvrtc.nvrtcAddNameExpression(prog, f"mlx::core::cu::{func}".encode())
    opts = [b"--gpu-architecture=sm_90", f"--include-path={args.cccl}".encode(),
            f"--include-path={args.cuda_include}".encode(), b"-lineinfo"]
    if nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)):
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise SystemExit(f"NVRTC failed: {log.value.decode(errors='replace')[-3000:]}")
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    return cubin.raw


def disassemble(cubin: bytes, nvdisasm: str) -> dict[int, tuple[str, list[int]]]:
    """offset -> (SASS text, lines of the kernel text) from `nvdisasm -gi`: the chain of source locations of
    each instruction, innermost (a helper's line, inlined) first, the kernel body's line last."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([nvdisasm, "-gi", "-c", f.name], capture_output=True, text=True, check=True).stdout
    table: dict[int, tuple[str, list[int]]] = {}
    chain: list[int] = []
    fresh = False
    for raw in out.splitlines():
        m = re.search(r'//## File ".*?", line (\d+)', raw)
        if m:
            if not fresh:
                chain, fresh = [], True
            chain.append(int(m.group(1)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", raw)
        if m:
            table[int(m.group(1), 16)] = (m.group(2), list(chain))
            fresh = False
    return table


def normal(sass: str) -> str:
    """SASS text as compared: no reuse flags, branch targets (an address or a label) as one word."""
    sass = re.sub(r"(0x[0-9a-f]{6,}|`\(\.L_x_\d+\))", "TARGET", sass.replace(".reuse", "").replace(";", " "))
    return " ".join(sass.split())


def opcode(sass: str) -> str:
    """The opcode of a SASS line ("@!P0 PRMT R1, ..." -> "PRMT")."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", normal(sass)).split(" ")[0].split(".")[0]


def lines_of(kernel: dict[str, Any], pcs: list[dict[str, Any]], table: dict[int, tuple[str, list[int]]],
             text_lines: list[str], top: int) -> dict[str, Any]:
    """The kernel's samples per line of its body (`lines`: the outermost location, where inlined helpers are
    called) and per innermost line (`inner_lines`: the helper's own line), with reasons where stall_sample.py
    kept them and, per body line, the helper lines its samples fell in (`via`)."""
    base = min(p["pc"] for p in pcs)
    reasons_of = {x["pc"]: x["reasons"] for x in kernel["instructions"]}

    def text(line: int) -> str:
        return text_lines[line - 1].strip() if 0 < line <= len(text_lines) else "?"

    tables: dict[str, dict[int, dict[str, Any]]] = {"lines": {}, "inner_lines": {}}
    match = 0
    for p in pcs:
        sass, chain = table.get(p["pc"] - base, ("?", [0]))
        chain = chain or [0]
        match += normal(sass) == normal(p["sass"])
        for key, line in (("lines", chain[-1]), ("inner_lines", chain[0])):
            row = tables[key].setdefault(line, {"line": line, "text": text(line), "samples": 0.0, "instructions": 0,
                                                "reasons": defaultdict(float), "opcodes": defaultdict(float),
                                                "via": defaultdict(float)})
            row["samples"] += p["samples"]
            row["instructions"] += 1
            row["opcodes"][opcode(p["sass"])] += p["samples"]
            if key == "lines" and len(chain) > 1:
                row["via"][f"L{chain[0]} {text(chain[0])[:60]}"] += p["samples"]
            for reason, value in reasons_of.get(p["pc"], {}).items():
                row["reasons"][reason] += value
    total = sum(p["samples"] for p in pcs)
    result: dict[str, Any] = {"sass_match": f"{match}/{len(pcs)}",
                              "reasons_cover": round(sum(x["samples"] for x in kernel["instructions"]) / total, 3)}
    for key, rows in tables.items():
        out = sorted(rows.values(), key=lambda r: -r["samples"])[:top]
        for r in out:
            r["share"] = round(r["samples"] / total, 4)
            for field, keep in (("reasons", 5), ("opcodes", 5), ("via", 4)):
                r[field] = dict(sorted(r[field].items(), key=lambda kv: -kv[1])[:keep])
            if key == "inner_lines":
                del r["via"]
        result[key] = out
        result[f"{key}_sampled"] = len(rows)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stalls", required=True)
    ap.add_argument("--pcs", required=True, help="folder of stall_sample.py's <impl>-<context>-<kernel>.pcs.json")
    ap.add_argument("--nvrtc", required=True)
    ap.add_argument("--nvdisasm", required=True)
    ap.add_argument("--cuda-include", required=True)
    ap.add_argument("--cccl", required=True)
    ap.add_argument("--mlx-headers", required=True)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--texts", default=None, help="folder for the rebuilt kernel texts (<kernel>.cu)")
    args = ap.parse_args()
    path = Path(args.stalls)
    result = json.loads(path.read_text())
    for case in result["cases"]:
        for kernel in case.get("kernels", []):
            name = kernel["kernel"]
            m = re.fullmatch(r"custom_kernel_(gmlx_kvarn_decode_[0-9a-f]{12})((?:_\d+){12})", name)
            if not m:
                continue
            template = dict(zip(TEMPLATE, map(int, m.group(2).strip("_").split("_"))))
            func = name
            text = kernel_text(func, template)
            from gmlx_lab.kernels.sources import cuda_name
            if cuda_name("kvarn_decode") != m.group(1):
                raise SystemExit(f"{name}: the kernel text here ({cuda_name('kvarn_decode')}) is not the one sampled")
            if args.texts:
                Path(args.texts).mkdir(parents=True, exist_ok=True)
                (Path(args.texts) / f"{func}.cu").write_text(text)
            table = disassemble(compile_lineinfo(text, func, args), args.nvdisasm)
            pcs = json.loads((Path(args.pcs) / f"{case['impl']}-{case['context']}-{name[:60]}.pcs.json").read_text())
            kernel.update(lines_of(kernel, pcs, table, text.splitlines(), args.top))
            kernel["lines_method"] = "stall_lines.py (NVRTC -lineinfo rebuild of the same text, nvdisasm -g)"
            print(f"{case['impl']} {case['context']}: sass match {kernel['sass_match']}, reasons cover "
                  f"{kernel['reasons_cover']}; top lines:")
            for r in kernel["lines"][:8]:
                print(f"  {r['share']:.1%} L{r['line']} {r['text'][:70]}  {dict(list(r['reasons'].items())[:3])}")
    path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
