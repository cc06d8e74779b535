"""Run a kernel body on CPU threads, one OS thread per GPU lane: the kernels' logic, tested without a GPU.

`launch` takes what `build.launch` takes. The body is compiled as CUDA would see it (the CUDA index
bindings, the template constants as `constexpr int`), but over `prelude_cpu.h` instead of the CUDA prelude:
warp operations (shuffles, the tensor-core fragment product, WARP_BARRIER) synchronize the 32 lanes of one
warp, BARRIER() a threadgroup, and threadgroups run one after another. g++ (C++20) compiles each source
once; the library is cached by a hash of its text. This checks indices, masks, splits, merges and the
float16 rounding of tensor-core operands; it measures nothing about speed, and a real GPU's memory model
is not reproduced. Used by the tests on machines where MLX has no GPU backend (see tests/conftest.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from .build import HERE, INDICES, compact, read

CXX = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing"]
C_TYPES = {mx.float32: "float", mx.float16: "HALF", mx.uint32: "uint32_t", mx.int32: "int32_t"}
NP_TYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.uint32: np.uint32, mx.int32: np.int32}
CACHE_DIR = Path(tempfile.gettempdir()) / "gmlx_cpu_threads"

_enabled = False


@contextmanager
def on_cpu_threads() -> Iterator[None]:
    """Within this block, `build.launch` runs kernels on CPU threads when MLX has no GPU backend."""
    global _enabled
    before, _enabled = _enabled, True
    try:
        yield
    finally:
        _enabled = before


def enabled() -> bool:
    return _enabled


def source(name: str, args: list[tuple[str, str, bool]], template: dict[str, int]) -> str:
    """C++ text: prelude_cpu.h, common.h and the kernel's helpers; the body as one threadgroup's function."""
    helpers = compact(read(f"{name}.h")) if (HERE / f"{name}.h").exists() else ""
    params = ",\n    ".join(f"{'' if out else 'const '}{t}* {n}" for n, t, out in args)
    consts = "".join(f"  constexpr int {k} = {int(v)};\n" for k, v in template.items())
    run_args = ", ".join(f"void* {n}_" for n, _, _ in args)
    casts = ", ".join(f"static_cast<{'' if out else 'const '}{t}*>({n}_)" for n, t, out in args)
    body = compact(read(f"{name}.body"))  # the text MLX gets (build.compact)
    return (f'#include "{HERE / "prelude_cpu.h"}"\n{compact(read("common.h"))}\n{helpers}\n'
            f"static void threadgroup(\n    {params}) {{\n{consts}{INDICES['cuda']}{body}\n}}\n\n"
            f'extern "C" void run({run_args}, u32 grid_y, u32 grid_z, u32 threads) {{\n'
            f"  gmlx_launch(grid_y, grid_z, threads, [&] {{ threadgroup({casts}); }});\n}}\n")


@cache
def _library(text: str) -> ctypes.CDLL:
    """The compiled source, cached on disk by a hash of its text (and of the prelude's)."""
    if shutil.which(CXX[0]) is None:
        raise RuntimeError("running kernels on CPU threads needs g++ (C++20): `bash tools/system_deps.sh` "
                           "installs it (apt-get install g++); on macOS install Xcode's command line tools")
    key = hashlib.sha256((text + read("prelude_cpu.h") + " ".join(CXX)).encode()).hexdigest()[:20]
    lib = CACHE_DIR / f"kernel_{key}.so"
    if not lib.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        cpp = lib.with_suffix(".cpp")
        cpp.write_text(text)
        tmp = lib.with_suffix(f".{id(text)}.tmp")
        res = subprocess.run([*CXX, str(cpp), "-o", str(tmp)], capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"g++ could not compile {cpp}:\n{res.stderr[-4000:]}")
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))


def launch(name: str, inputs: dict[str, mx.array], outputs: dict[str, tuple[tuple[int, ...], mx.Dtype]],
           grid: tuple[int, int, int], threadgroup: tuple[int, int, int], template: dict[str, int]) -> list[mx.array]:
    """`build.launch` on CPU threads: grid counts threads (as in MLX); threadgroups are (x, 1, 1), x % 32 == 0."""
    threads = threadgroup[0]
    if threadgroup[1:] != (1, 1) or threads % 32 or grid[0] != threads:
        raise ValueError(f"kernel {name}: CPU threads run grids of (threadgroup, y, z) with a threadgroup of "
                         f"(32k, 1, 1); got grid {grid}, threadgroup {threadgroup}")
    for key, arr in inputs.items():
        if arr.dtype not in C_TYPES:
            raise ValueError(f"kernel {name}: input {key} has dtype {arr.dtype}; CPU threads accept "
                             f"{', '.join(str(t) for t in C_TYPES)}")
    args = [(k, C_TYPES[a.dtype], False) for k, a in inputs.items()]
    args += [(k, C_TYPES[dtype], True) for k, (_, dtype) in outputs.items()]
    arrays = [np.ascontiguousarray(np.array(a)) for a in inputs.values()]
    # outputs start as nan (or a pattern) so that anything the kernel leaves unwritten shows up
    outs = [np.full(shape, np.nan if dtype in (mx.float32, mx.float16) else 0xDEAD, NP_TYPES[dtype])
            for shape, dtype in outputs.values()]
    lib = _library(source(name, args, template))
    lib.run(*(a.ctypes.data_as(ctypes.c_void_p) for a in arrays + outs),
            ctypes.c_uint(grid[1]), ctypes.c_uint(grid[2]), ctypes.c_uint(threads))
    return [mx.array(o) for o in outs]
