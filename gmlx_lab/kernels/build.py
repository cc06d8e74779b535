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

import os
import re
from collections.abc import Callable
from functools import cache, lru_cache, partial
from pathlib import Path
from typing import Any

import mlx.core as mx

HERE = Path(__file__).parent
BACKENDS = ("cuda", "metal")
COMPILE_ENV = "GMLX_COMPILE_DECODE"  # "0": decode attention builds its kernel calls in Python every step
compile_graphs = os.environ.get(COMPILE_ENV, "1") != "0"

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


def active_backend() -> str:
    """'cuda' or 'metal' when MLX runs on that GPU backend, else 'cpu'. A decode step asks this often, so only the
    default device is read each time (it can change: `mx.set_default_device`); the GPU's backend once."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    return gpu_backend()


@cache
def gpu_backend() -> str:
    """The backend of MLX's GPU device: 'cuda', 'metal', or 'cpu' where this MLX has neither."""
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return "cpu"


def kernel_backend() -> str:
    """The source that `launch` runs: 'cuda' or 'metal' (on that GPU, or on CPU threads inside
    `threads.on_cpu_threads`), else 'cpu'. Launch settings that differ per backend follow it."""
    backend = active_backend()
    if backend == "cpu":
        from . import threads

        if threads.enabled():
            return threads.current_source()
    return backend


# Preprocessor constants that a kernel's CUDA header starts with, by kernel (decode.py sets kvarn_decode's launch
# bounds). They join the kernel's name, so that MLX never reuses a kernel compiled with other values.
CUDA_DEFINES: dict[str, dict[str, int]] = {}


def cuda_name(name: str) -> str:
    """The name MLX gets for kernel `name` on CUDA: gmlx_<name>, then each of its CUDA_DEFINES."""
    return f"gmlx_{name}" + "".join(f"_{k.lower()}{v}" for k, v in CUDA_DEFINES.get(name, {}).items())


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


def metal_device_inputs(inputs: dict[str, mx.array]) -> dict[str, mx.array]:
    """`inputs` with each one of fewer than 8 elements padded to 8 (flattened, zeros after its values).

    mx.fast.metal_kernel passes such small inputs in Metal's `constant` address space, and Metal converts no
    pointer between address spaces: a body that takes a `GLOBAL_CONST` (`const device`) pointer into one, as
    split_merge does into a small part_lse or kvarn_decode into its placeholder for absent recent tokens,
    would not compile. The kernels never read the padding."""
    return {k: a if a.size >= METAL_CONSTANT_SIZE else mx.pad(a.flatten(), (0, METAL_CONSTANT_SIZE - a.size))
            for k, a in inputs.items()}


@cache
def _kernel(name: str, backend: str, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> Any:
    header, source = (compact(text) for text in assemble(name, backend))
    if backend == "cuda":
        return mx.fast.cuda_kernel(name=cuda_name(name), input_names=list(inputs), output_names=list(outputs),
                                   source=source, header=header, ensure_row_contiguous=True)
    return mx.fast.metal_kernel(name=f"gmlx_{name}", input_names=list(inputs), output_names=list(outputs),
                                source=source, header=header, ensure_row_contiguous=True)


def forget_kernels() -> None:
    """Drop the compiled kernel objects and graphs, so the next launch compiles the sources as they read now."""
    _kernel.cache_clear()
    _compiled.cache_clear()


@cache
def _template(items: tuple[tuple[str, int], ...]) -> list[tuple[str, int]]:
    """The template argument list MLX takes, built once per set of values (decode steps repeat them)."""
    return [(k, int(v)) for k, v in items]


def launch(name: str, inputs: dict[str, mx.array], outputs: dict[str, tuple[tuple[int, ...], mx.Dtype]],
           grid: tuple[int, int, int], threadgroup: tuple[int, int, int], template: dict[str, int]) -> list[mx.array]:
    """Run kernel `name` on the active GPU backend; grid counts threads, as in both MLX APIs.

    A decode step calls this twice per layer, so it does little Python: one backend query, cached kernel
    objects and template lists."""
    backend = active_backend()
    if backend == "cpu":
        from . import threads

        if not threads.enabled():
            raise RuntimeError(f"kernel {name}: no GPU backend is active (MLX runs on the CPU); use the reference path")
        # tests: the CUDA or Metal source on CPU threads (threads.py), with the inputs that backend would get
        source = threads.current_source()
        if source == "metal":
            inputs = metal_device_inputs(inputs)
        return threads.launch(name, inputs, outputs, grid, threadgroup, template, source=source)
    if backend == "metal":
        inputs = metal_device_inputs(inputs)
    kernel = _kernel(name, backend, tuple(inputs), tuple(outputs))
    return kernel(
        inputs=list(inputs.values()),
        template=_template(tuple(template.items())),
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[s for s, _ in outputs.values()],
        output_dtypes=[d for _, d in outputs.values()],
    )


def run_graph(graph: Callable[..., mx.array], key: Any, *arrays: mx.array) -> mx.array:
    """`graph(key, *arrays)`: on a GPU backend compiled with `mx.compile`, once per key and input shapes.

    A decode step calls its attention graph once per layer, and building it in Python (two kernel calls, whose
    sources MLX assembles at each call) costs the host more than the GPU spends on it at short contexts; a
    compiled graph is replayed in C++ with the kernels built once. `key` (plain values) with the arrays' shapes
    and dtypes must fix the graph: every value that changes between steps is one of `arrays`, never captured.
    The CPU (and CPU threads, which run kernels eagerly) calls `graph` as it is; so does `compile_graphs = False`
    (or GMLX_COMPILE_DECODE=0), which benchmarks/model_decode.py measures side by side."""
    if not compile_graphs or active_backend() == "cpu":
        return graph(key, *arrays)
    return _compiled(graph, key)(*arrays)


@lru_cache(maxsize=32)
def _compiled(graph: Callable[..., mx.array], key: Any) -> Callable[..., mx.array]:
    """One compiled graph per key; the oldest are dropped (a decode's geometry moves on every 128 tokens)."""
    return mx.compile(partial(graph, key))
