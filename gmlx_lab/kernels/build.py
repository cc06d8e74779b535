"""Where the kernels run: the choice of backend, launching a kernel there, and compiled decode graphs.

A kernel's text comes from `sources` (one body per kernel, a prelude per backend). On CUDA `launch` runs the
cubin that `precompiled` keeps on disk (compiled by NVRTC once per machine): handed to MLX's module cache and
launched with mx.fast.cuda_kernel, or else through mx.fast.precompiled_cuda_kernel; where no cubin can be had
(said once) mx.fast.cuda_kernel compiles the text in each process. On Metal mx.fast.metal_kernel. On the CPU there is
no kernel (callers use the pure-MLX reference), except inside `threads.on_cpu_threads()`, where the tests run
the CUDA or Metal source on CPU threads.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, lru_cache, partial
from typing import Any

import mlx.core as mx

from . import config, precompiled, threads
from .sources import METAL_CONSTANT_SIZE, assemble, compact, cuda_name


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
        if threads.enabled():
            return threads.current_source()
    return backend


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
    precompiled.forget()


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
        if not threads.enabled():
            raise RuntimeError(f"kernel {name}: no GPU backend is active (MLX runs on the CPU); use the reference path")
        # tests: the CUDA or Metal source on CPU threads (threads.py), with the inputs that backend would get
        source = threads.current_source()
        if source == "metal":
            inputs = metal_device_inputs(inputs)
        return threads.launch(name, inputs, outputs, grid, threadgroup, template, source=source)
    if backend == "metal":
        inputs = metal_device_inputs(inputs)
    elif config.current().kernel_cache:
        signature = (tuple((k, a.dtype) for k, a in inputs.items()), tuple((k, d) for k, (_, d) in outputs.items()),
                     tuple(template.items()))
        # the disk's binary handed to MLX's module cache: cuda_kernel below loads it (a cheaper launch); else
        # run it with precompiled_cuda_kernel; else (no binary) cuda_kernel compiles the text
        found = None if precompiled.handed(name, *signature) else precompiled.binary(name, *signature)
        if found is not None:
            return mx.fast.precompiled_cuda_kernel(
                name=found[0], compiled_source=found[1], inputs=list(inputs.values()),
                output_shapes=[s for s, _ in outputs.values()], output_dtypes=[d for _, d in outputs.values()],
                scalars=[], grid=grid, threadgroup=threadgroup, ensure_row_contiguous=True)
    kernel = _kernel(name, backend, tuple(inputs), tuple(outputs))
    return kernel(
        inputs=list(inputs.values()),
        template=_template(tuple(template.items())),
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[s for s, _ in outputs.values()],
        output_dtypes=[d for _, d in outputs.values()],
    )


def graph_function(graph: Callable[..., mx.array], key: Any) -> Callable[..., mx.array]:
    """`graph` with its key bound: on a GPU backend compiled with `mx.compile`, once per key (and, within it, per
    input shapes); the CPU (and CPU threads, which run kernels eagerly) gets `graph` as it is.

    A decode step calls its attention graph once per layer, and building it in Python (two kernel calls, whose
    sources MLX assembles at each call) costs the host more than the GPU spends on it at short contexts; a
    compiled graph is replayed in C++ with the kernels built once. `key` (plain values) with the arrays' shapes
    and dtypes must fix the graph: every value that changes between steps is an input, never captured. A caller
    that runs the same graph every step keeps it while the backend and the settings stay (decode.KvarnCall,
    decode.AffineCall)."""
    if active_backend() == "cpu":
        return partial(graph, key)
    return _compiled(graph, key)


@lru_cache(maxsize=32)
def _compiled(graph: Callable[..., mx.array], key: Any) -> Callable[..., mx.array]:
    """One compiled graph per key; the oldest are dropped (a decode's geometry moves on every 128 tokens)."""
    return mx.compile(partial(graph, key))
