"""Registers, stack and threadgroups a multiprocessor of each fused CUDA kernel, compiled offline: no GPU needed.

Usage: python benchmarks/kernel_resources.py --schemes affine4,kivi4,turboquant4,mxfp4,nvfp4,mxfp8,kvarn4 \\
           --out benchmarks/results/kernel_resources-cpu.json
(needs the `nvidia-cuda-nvrtc` wheel, the library MLX's CUDA backend compiles with, and g++ for the CPU threads)

A kernel's registers a thread decide how many of its threadgroups a multiprocessor holds (65536 registers on an
H100 or H200, allocated 8 a thread at a time), and the launch plans count on that (affine.AFFINE_GROUPS assumes four
affine_decode threadgroups a multiprocessor; kvarn_decode's launch bounds ask for three). For each scheme the cache
is filled on this CPU and one decode step runs its kernels' CUDA source on CPU threads (kernels/threads.py), which
records every launch's argument types and template constants; each such text (`precompiled.kernel_text`, as MLX
compiles it) goes to NVRTC for `--arch`, and the cubin's .nv.info section gives the registers a thread and the
stack frame (bytes a thread spilled to local memory). A variant of a body can be checked this way before a GPU
times it; the numbers are NVRTC's for this wheel's version, which may differ from the GPU machine's by a few.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
from decode_attention import D, fused_affine_state, fused_block_state, fused_kvarn_state, random_qkv
from model_decode import git_commit

from gmlx_lab.kernels import precompiled, threads
from gmlx_lab.kernels.sources import cuda_name

REGISTERS_PER_SM = 65536
REGCOUNT, FRAME_SIZE = 0x2F, 0x11  # .nv.info attributes (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE): (symbol, value)


def elf_sections(cubin: bytes) -> dict[str, bytes]:
    """The sections of a 64-bit little-endian ELF file, by name."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    table = headers[names]
    strings = cubin[table[4]:table[4] + table[5]]

    def name(at: int) -> str:
        return strings[at:strings.index(b"\0", at)].decode()
    return {name(h[0]): cubin[h[4]:h[4] + h[5]] for h in headers}


def nv_info(cubin: bytes) -> dict[int, int]:
    """Attribute -> largest value over the kernel's functions, for the (symbol, value) attributes of .nv.info.
    Each entry: a format byte, an attribute byte, then a 16-bit size and that many bytes (format 4) or a 16-bit
    value (formats 1-3)."""
    blob, out, i = elf_sections(cubin).get(".nv.info", b""), {}, 0
    while i + 4 <= len(blob):
        fmt, attr = blob[i], blob[i + 1]
        size = struct.unpack_from("<H", blob, i + 2)[0] if fmt == 4 else 0
        if fmt == 4 and size == 8:
            out[attr] = max(out.get(attr, 0), struct.unpack_from("<II", blob, i + 4)[1])
        i += 4 + size
    return out


def launches(spec: str, tokens: int) -> list[tuple[str, tuple, tuple, dict[str, int], int]]:
    """(kernel, input types, output types, template, threads a group) of each launch of one decode step of `spec`,
    its CUDA source run on CPU threads."""
    seen: dict[Any, tuple] = {}
    real = threads.launch

    def record(name, inputs, outputs, grid, group, template, source="cuda"):
        key = (name, tuple(sorted(template.items())))
        seen.setdefault(key, (name, tuple((k, a.dtype) for k, a in inputs.items()),
                              tuple((k, dt) for k, (_, dt) in outputs.items()), dict(template), group[0]))
        return real(name, inputs, outputs, grid, group, template, source=source)
    q, k, v = random_qkv(tokens)
    threads.launch = record
    try:
        with threads.on_cpu_threads("cuda"):
            if spec.startswith("affine"):
                fn = fused_affine_state([q], k, v, D**-0.5, int(spec.removeprefix("affine")))[0]
            elif spec.startswith("kvarn"):
                fn = fused_kvarn_state([q], k, v, D**-0.5, int(spec.removeprefix("kvarn")))[0]
            else:
                fn = fused_block_state([q], k, v, D**-0.5, spec)[0]
            mx.eval(fn())
    finally:
        threads.launch = real
    return list(seen.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schemes", default="affine4,kivi4,turboquant4,mxfp4,nvfp4,mxfp8,kvarn4")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in each cache (enough for blocks)")
    parser.add_argument("--arch", default="sm_90a", help="NVRTC's --gpu-architecture (H100, H200: sm_90a)")
    parser.add_argument("--out", default="benchmarks/results/kernel_resources-cpu.json")
    args = parser.parse_args(argv)
    try:
        compiler = precompiled.nvrtc()
    except RuntimeError as exc:
        parser.error(f"{exc}: `pip install nvidia-cuda-nvrtc` into this environment")
    rows = []
    for spec in args.schemes.split(","):
        for name, inputs, outputs, template, group in launches(spec, args.tokens):
            text = precompiled.kernel_text(cuda_name(name), name, inputs, outputs, template)
            info = nv_info(compiler.compile(text, args.arch, f"{cuda_name(name)}.cu"))
            regs = info[REGCOUNT]
            per_sm = REGISTERS_PER_SM // (-(-regs // 8) * 8 * group)
            rows.append({"scheme": spec, "kernel": name, "template": template, "threads": group,
                         "registers": regs, "stack_bytes": info.get(FRAME_SIZE, 0), "groups_per_sm": per_sm})
            print(f"{spec:12s} {name:14s} {regs:4d} registers, {info.get(FRAME_SIZE, 0):3d} B stack, "
                  f"{per_sm} threadgroups of {group} a multiprocessor (by registers)", file=sys.stderr)
    result = {"arch": args.arch, "nvrtc": compiler.version, "mlx": mx.__version__, "commit": git_commit(),
              "command": " ".join(["kernel_resources.py", *(argv if argv is not None else sys.argv[1:])]),
              "method": __doc__.split("\n\n")[2].replace("\n", " "), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
