"""One kernel body per kernel, a thin prelude per backend, and the choice of backend.

Each kernel lives in one `<name>.body` file written in a small common dialect:
`SHARED`, `BARRIER()`, `GLOBAL_CONST`, `HALF`/`TO_FLOAT`, `simd_sum_f`/`simd_max_f`, `TID`,
`GROUP_Y`, `LANE`, ... The prelude of the active backend (`prelude_cuda.h` or
`prelude_metal.h`, plus `common.h`) defines those names for `mx.fast.cuda_kernel` or
`mx.fast.metal_kernel`, and a few backend lines at the top of the body bind the thread and
group indices (on Metal these must appear in the body so MLX adds the matching attributes).
On the CPU there is no kernel: callers use the pure-MLX reference.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx

HERE = Path(__file__).parent
BACKENDS = ("cuda", "metal")

# Index bindings placed at the top of every body: the body only says TID, GROUP_Y, ...
INDICES = {
    "cuda": (
        "  const u32 TID = threadIdx.x;\n"
        "  const u32 GROUP_Y = blockIdx.y, GROUP_Z = blockIdx.z;\n"
        "  const u32 GLOBAL_X = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "  const u32 LANE = threadIdx.x & 31u, WARP_ID = threadIdx.x >> 5;\n"
    ),
    "metal": (
        "  const u32 TID = thread_position_in_threadgroup.x;\n"
        "  const u32 GROUP_Y = threadgroup_position_in_grid.y, GROUP_Z = threadgroup_position_in_grid.z;\n"
        "  const u32 GLOBAL_X = thread_position_in_grid.x;\n"
        "  const u32 LANE = thread_index_in_simdgroup, WARP_ID = simdgroup_index_in_threadgroup;\n"
    ),
}


def active_backend() -> str:
    """'cuda' or 'metal' when MLX runs on that GPU backend, else 'cpu'."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return "cpu"


def read(name: str) -> str:
    """The text of one file of this folder."""
    return (HERE / name).read_text()


def assemble(name: str, backend: str) -> tuple[str, str]:
    """(header, source) of kernel `name` for `backend`: prelude + common helpers (+ `<name>.h`), index lines + body."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend {backend!r} is not supported; accepted: {', '.join(BACKENDS)}")
    header = read(f"prelude_{backend}.h") + "\n" + read("common.h")
    if (HERE / f"{name}.h").exists():  # the kernel's own helper functions
        header += "\n" + read(f"{name}.h")
    return header, INDICES[backend] + read(f"{name}.body")


def compact(text: str) -> str:
    """Kernel text without comments and blank lines: MLX copies and hashes a custom kernel's whole source at
    every call (graph building and evaluation), so a shorter text is a cheaper decode step."""
    lines = (re.sub(r"\s*//.*$", "", line).rstrip() for line in text.splitlines())
    return "\n".join(line for line in lines if line.strip()) + "\n"


@cache
def _kernel(name: str, backend: str, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> Any:
    header, source = (compact(text) for text in assemble(name, backend))
    if backend == "cuda":
        return mx.fast.cuda_kernel(name=f"gmlx_{name}", input_names=list(inputs), output_names=list(outputs),
                                   source=source, header=header, ensure_row_contiguous=True)
    return mx.fast.metal_kernel(name=f"gmlx_{name}", input_names=list(inputs), output_names=list(outputs),
                                source=source, header=header, ensure_row_contiguous=True)


def launch(name: str, inputs: dict[str, mx.array], outputs: dict[str, tuple[tuple[int, ...], mx.Dtype]],
           grid: tuple[int, int, int], threadgroup: tuple[int, int, int], template: dict[str, int]) -> list[mx.array]:
    """Run kernel `name` on the active GPU backend; grid counts threads, as in both MLX APIs."""
    backend = active_backend()
    if backend == "cpu":
        from . import threads

        if threads.enabled():  # tests: the same body on CPU threads (threads.py)
            return threads.launch(name, inputs, outputs, grid, threadgroup, template)
        raise RuntimeError(f"kernel {name}: no GPU backend is active (MLX runs on the CPU); use the reference path")
    kernel = _kernel(name, backend, tuple(inputs), tuple(outputs))
    return kernel(
        inputs=list(inputs.values()),
        template=[(k, int(v)) for k, v in template.items()],
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[s for s, _ in outputs.values()],
        output_dtypes=[d for _, d in outputs.values()],
    )
