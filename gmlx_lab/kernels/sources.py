"""The kernels' texts: one body per kernel, a thin prelude per backend, assembled as MLX compiles them.

Each kernel lives in one `<name>.body` file written in a small common dialect:
`SHARED`, `BARRIER()`, `GLOBAL_CONST`, `HALF`/`TO_FLOAT`, `simd_sum_f`/`simd_max_f`, `TID`,
`GROUP_Y`, `LANE`, ... The prelude of the backend (`prelude_cuda.h` or `prelude_metal.h`, plus
`common.h`) defines those names for `mx.fast.cuda_kernel` or `mx.fast.metal_kernel`, and a few backend
lines at the top of the body bind the thread and group indices (on Metal these must appear in the body so
MLX adds the matching attributes). `build` launches these texts on a GPU, `threads` on CPU threads.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

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


# What mx.fast.metal_kernel (MLX 0.32.4, mlx/backend/common/metal_kernel.cpp) writes around a source:
# the Metal type of each dtype, the inputs it passes in the `constant` address space (fewer elements than
# this), and the thread-index arguments it adds, in this order, when their names occur in the source.
METAL_TYPES = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.int32: "int32_t",
               mx.uint32: "uint32_t", mx.int64: "int64_t", mx.uint64: "uint64_t", mx.uint8: "uint8_t",
               mx.int8: "int8_t", mx.uint16: "uint16_t", mx.int16: "int16_t", mx.bool_: "bool"}
METAL_CONSTANT_SIZE = 8
METAL_ATTRIBUTES = {
    "dispatch_quadgroups_per_threadgroup": "uint", "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3", "grid_origin": "uint3", "grid_size": "uint3",
    "quadgroup_index_in_threadgroup": "uint", "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint", "simdgroups_per_threadgroup": "uint", "thread_execution_width": "uint",
    "thread_index_in_quadgroup": "uint", "thread_index_in_simdgroup": "uint", "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3", "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3", "threadgroups_per_grid": "uint3", "threads_per_grid": "uint3",
    "threads_per_simdgroup": "uint", "threads_per_threadgroup": "uint3",
}


# Preprocessor constants that a kernel's CUDA header starts with, by kernel (kvarn.py sets kvarn_decode's launch
# bounds). They join the kernel's name, so that MLX never reuses a kernel compiled with other values.
CUDA_DEFINES: dict[str, dict[str, int]] = {}


def cuda_name(name: str) -> str:
    """The name MLX gets for kernel `name` on CUDA: gmlx_<name>_<hash of its text>. MLX keeps compiled CUDA
    kernels by name (custom kernels in the process only, in MLX 0.32), so a text that changes (another version
    of gmlx_lab, a constant of CUDA_DEFINES, a test's edit) must change the name."""
    text = "".join(compact(part) for part in assemble(name, "cuda"))
    return f"gmlx_{name}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def read(name: str) -> str:
    """The text of one file of this folder."""
    return (HERE / name).read_text()


def assemble(name: str, backend: str) -> tuple[str, str]:
    """(header, source) of kernel `name` for `backend`: prelude + common helpers (+ `<name>.h`), index lines + body."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend {backend!r} is not supported; accepted: {', '.join(BACKENDS)}")
    defines = CUDA_DEFINES.get(name, {}) if backend == "cuda" else {}
    header = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    header += read(f"prelude_{backend}.h") + "\n" + read("common.h")
    if (HERE / f"{name}.h").exists():  # the kernel's own helper functions
        header += "\n" + read(f"{name}.h")
    return header, INDICES[backend] + read(f"{name}.body")


def compact(text: str) -> str:
    """Kernel text without comments and blank lines: MLX copies and hashes a custom kernel's whole source at
    every call (graph building and evaluation), so a shorter text is a cheaper decode step."""
    lines = (re.sub(r"\s*//.*$", "", line).rstrip() for line in text.splitlines())
    return "\n".join(line for line in lines if line.strip()) + "\n"


def metal_attributes(source: str) -> list[str]:
    """The thread-index arguments mx.fast.metal_kernel adds to a kernel whose source (not header) is `source`."""
    return [attr for attr in METAL_ATTRIBUTES if attr in source]


def metal_source(name: str, inputs: dict[str, mx.array], outputs: dict[str, tuple[tuple[int, ...], mx.Dtype]],
                 template: dict[str, int]) -> tuple[str, str]:
    """(kernel name, full text) of kernel `name` as mx.fast.metal_kernel (MLX 0.32.4) generates it for these
    inputs, output dtypes and integer template constants: our header, `template <int ...>`, the
    `[[kernel]] void` signature (inputs, their `_shape`/`_strides`/`_ndim` when the source names them,
    outputs, thread-index arguments), the index lines + body, and the template's explicit instantiation.
    MLX compiles its Metal preamble (<metal_stdlib>, `using namespace metal;`) followed by this text;
    tests/test_metal_threads.py checks it against MLX's own text."""
    header, source = (compact(text) for text in assemble(name, "metal"))  # what _kernel gives MLX
    kname = f"custom_kernel_gmlx_{name}"
    args = ", ".join(str(int(v)) for v in template.values())
    if template:  # <6, 6, 1> becomes _6_6_1
        kname += "_" + f"<{args}>".replace(", ", "_").replace("<", "_").replace(">", "_")[:-1]
    for a in inputs.values():  # how each input is passed is part of the name: s(calar), c(onstant)
        kname += "_" + METAL_TYPES[a.dtype] + ("s" if a.ndim == 0 else "c" if a.size < METAL_CONSTANT_SIZE else "")
    kname += "".join("_" + METAL_TYPES[dtype] for _, dtype in outputs.values())

    text = header
    if template:
        text += "template <" + ", ".join(f"int {k}" for k in template) + ">\n"
    text += f"[[kernel]] void {kname}(\n"
    index = 0
    for n, a in inputs.items():
        space = "constant" if a.size < METAL_CONSTANT_SIZE else "device"
        text += f"  const {space} {METAL_TYPES[a.dtype]}{'&' if a.ndim == 0 else '*'} {n} [[buffer({index})]],\n"
        index += 1
        for suffix, ctype in (("_shape", "int*"), ("_strides", "int64_t*"), ("_ndim", "int&")):
            if a.ndim > 0 and n + suffix in source:
                text += f"  const constant {ctype} {n}{suffix} [[buffer({index})]],\n"
                index += 1
    attributes = metal_attributes(source)
    for n, (_, dtype) in outputs.items():
        # as MLX writes it: `index` also counts the _shape/_strides/_ndim buffers
        last = index >= len(inputs) + len(outputs) - 1 and not attributes
        text += f"  device {METAL_TYPES[dtype]}* {n} [[buffer({index})]]" + (") {\n" if last else ",\n")
        index += 1
    text += ",\n".join(f"  {METAL_ATTRIBUTES[attr]} {attr} [[{attr}]]" for attr in attributes)
    text += ") {\n" if attributes else ""
    text += source + "\n}\n"
    if template:
        inst = f"{kname}<{args}>"
        text += f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({inst}) {inst};\n'
    return kname, text


