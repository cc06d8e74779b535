"""Run a kernel's CUDA or Metal source on the CPU, one CPU thread (a fiber) per GPU lane: the kernels' logic,
tested without a GPU.

`launch` takes what `build.launch` takes, plus the source to run:
- "cuda": the body as CUDA would see it (the CUDA index bindings, the template constants as `constexpr int`),
  compiled over `prelude_cpu.h` instead of the CUDA prelude, whose tensor-core product is the PTX instruction;
- "metal": the whole text that mx.fast.metal_kernel compiles on a Mac (`sources.metal_source`: Metal prelude,
  signature, body, template instantiation), compiled over `shim_metal_cpu.h` in place of MLX's Metal
  preamble, so the Metal prelude's own code runs, its SIMD-shuffle `mma16816` included. The only change to
  that text: its threadgroup variables become `static` (`threadgroup_storage_static`).
Both run on cpu_lanes.h: each lane is a fiber (its own stack; the lanes of a threadgroup take turns on the
calling thread), SIMD-group operations (shuffles, reductions, WARP_BARRIER) synchronize the 32 lanes of one
warp, BARRIER() a threadgroup, and threadgroups run one after another; a barrier that not all lanes reach is
reported as a deadlock. g++ (C++20) compiles each source once, the standard headers precompiled; the library is
cached on disk by a hash of its text. This checks indices, masks, splits, merges, the float16 rounding of
tensor-core operands and (Metal) that the generated source compiles with its address spaces kept apart and fits
Apple's 32 KB of threadgroup memory; it measures nothing about speed, and a real GPU's memory model and
scheduling are not reproduced. Used by the tests on machines where MLX has no GPU backend (see tests/conftest.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import sources
from .sources import HERE, INDICES, METAL_CONSTANT_SIZE, METAL_TYPES, assemble, compact, metal_attributes, metal_source

CXX = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-fno-strict-aliasing", "-Wno-attributes"]
HEADERS = ("cpu_lanes.h", "prelude_cpu.h", "shim_metal_cpu.h")  # their text joins the cache key
C_TYPES = {mx.float32: "float", mx.float16: "HALF", mx.uint32: "uint32_t", mx.int32: "int32_t", mx.uint8: "uint8_t"}
NP_TYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.uint32: np.uint32, mx.int32: np.int32,
            mx.uint8: np.uint8}
CACHE_DIR = Path(tempfile.gettempdir()) / "gmlx_cpu_threads"
SOURCES = ("cuda", "metal")
METAL_THREADGROUP_BYTES = 32768  # threadgroup memory of one threadgroup on Apple GPUs (M1 to M4)
CUDA_STATIC_SHARED_BYTES = 49152  # static shared memory of one CUDA thread block (NVRTC refuses more)

_source: str | None = None  # which source build.launch runs on CPU threads; None: it does not


@contextmanager
def on_cpu_threads(source: str = "cuda") -> Iterator[None]:
    """Within this block, `build.launch` runs kernels on CPU threads when MLX has no GPU backend, from their
    CUDA (`source="cuda"`) or Metal (`source="metal"`) source."""
    global _source
    if source not in SOURCES:
        raise ValueError(f"CPU threads run the {' or '.join(SOURCES)} source, not {source!r}")
    before, _source = _source, source
    try:
        yield
    finally:
        _source = before


def enabled() -> bool:
    return _source is not None


def current_source() -> str:
    """The source ("cuda" or "metal") that kernels run from inside `on_cpu_threads`."""
    if _source is None:
        raise RuntimeError("kernels run on CPU threads only inside threads.on_cpu_threads()")
    return _source


def cuda_cpp(name: str, args: list[tuple[str, str, bool]], template: dict[str, int]) -> str:
    """C++ text for the CUDA source: prelude_cpu.h, common.h and the kernel's helpers; the body as one
    threadgroup's function; run(), which starts the lanes."""
    helpers = compact(sources.read(f"{name}.h")) if (HERE / f"{name}.h").exists() else ""
    params = ",\n    ".join(f"{'' if out else 'const '}{t}* {n}" for n, t, out in args)
    consts = "".join(f"  constexpr int {k} = {int(v)};\n" for k, v in template.items())
    casts = ", ".join(f"static_cast<{'' if out else 'const '}{t}*>(args[{i}])" for i, (_, t, out) in enumerate(args))
    body = compact(sources.read(f"{name}.body"))  # the text MLX gets (sources.compact)
    return (f'#include "{HERE / "prelude_cpu.h"}"\n{compact(sources.read("common.h"))}\n{helpers}\n'
            f"static void threadgroup(\n    {params}) {{\n{consts}{INDICES['cuda']}{body}\n}}\n\n"
            f'extern "C" bool run(void** args, u32 grid_y, u32 grid_z, u32 threads) {{\n'
            f"  return gmlx_launch(grid_y, grid_z, threads, [&] {{ threadgroup({casts}); }});\n}}\n")


# `threadgroup`, a type (`float`, `float4`, `vec<T, N>`) and a name, then `[`, `;` or `,`: a threadgroup variable
# (a pointer's declaration has a `*` before the name, a cast or parameter a `*` or `&` too)
THREADGROUP_VARIABLE = re.compile(r"\bthreadgroup(\s+(?:const\s+)?[A-Za-z_][\w:]*(?:<[^<>;]*>)?"  # the type
                                  r"\s+[A-Za-z_]\w*\s*[\[;,])")  # the name


def threadgroup_storage_static(text: str) -> str:
    """`threadgroup float x[N];` becomes `static float x[N];`: one copy that every thread of the running
    threadgroup shares (threadgroups run in turn), as Metal's threadgroup memory. `threadgroup` qualifying a
    pointer (`threadgroup float* p`, casts, parameters) is left to the shim, which defines it as nothing."""
    return THREADGROUP_VARIABLE.sub(r"static\1", text)


@cache
def _preprocessed(metal: str) -> str:
    """The Metal text with its macros expanded (g++ -E, without the shim: `threadgroup` stays a word), so that
    the declarations that SHARED expands to can be found; line markers keep the .metal file's line numbers."""
    path = CACHE_DIR / f"kernel_{hashlib.sha256(metal.encode()).hexdigest()[:20]}.metal"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(metal)
    res = subprocess.run([CXX[0], "-std=c++20", "-E", "-x", "c++", str(path)], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"g++ could not preprocess {path}:\n{res.stderr[-4000:]}")
    return res.stdout


def metal_cpp(name: str, inputs: dict[str, mx.array], outputs: dict[str, tuple[tuple[int, ...], mx.Dtype]],
              template: dict[str, int]) -> tuple[str, str]:
    """(kernel name, C++ text) for the Metal source: shim_metal_cpu.h, the text mx.fast.metal_kernel compiles
    (macros expanded, threadgroup variables made static), and run(), which calls the kernel once per lane with
    its indices."""
    kname, text = metal_source(name, inputs, outputs, template)
    body = assemble(name, "metal")[1]
    extras = [n + s for n in inputs for s in ("_shape", "_strides", "_ndim") if n + s in body]
    if extras:
        raise ValueError(f"kernel {name}: CPU threads do not pass {', '.join(extras)} (no body here uses them)")
    args = [f"{'*' if a.ndim == 0 else ''}static_cast<const {'constant' if a.size < METAL_CONSTANT_SIZE else 'device'} "
            f"{METAL_TYPES[a.dtype]}*>(args[{i}])" for i, a in enumerate(inputs.values())]
    args += [f"static_cast<device {METAL_TYPES[dtype]}*>(args[{len(inputs) + i}])"
             for i, (_, dtype) in enumerate(outputs.values())]
    args += [f"ids.{attr}" for attr in metal_attributes(body)]
    call = f"{kname}<{', '.join(str(int(v)) for v in template.values())}>" if template else kname
    return kname, (f'#include "{HERE / "shim_metal_cpu.h"}"\n{threadgroup_storage_static(_preprocessed(text))}\n'
                   f'#line 1 "run"\nextern "C" bool run(void** args, uint grid_y, uint grid_z, uint threads) {{\n'
                   f"  return gmlx_metal_launch(grid_y, grid_z, threads, [&](const MetalIds& ids) {{\n"
                   f"    {call}(\n      " + ",\n      ".join(args) + ");\n  });\n}\n")


@cache
def _library(text: str) -> Path:
    """The compiled source, cached on disk by a hash of its text (and of the headers')."""
    if shutil.which(CXX[0]) is None:
        raise RuntimeError("running kernels on CPU threads needs g++ (C++20): `bash tools/system_deps.sh` "
                           "installs it (apt-get install g++); on macOS install Xcode's command line tools")
    key = hashlib.sha256((text + "".join(map(sources.read, HEADERS)) + " ".join(CXX)).encode()).hexdigest()[:20]
    lib = CACHE_DIR / f"kernel_{key}.so"
    if not lib.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        cpp = lib.with_suffix(".cpp")
        cpp.write_text(text)
        tmp = lib.with_suffix(f".{id(text)}.tmp")
        res = subprocess.run([*CXX, "-include", str(_standard_headers(tuple(CXX))), str(cpp), "-o", str(tmp)],
                             capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"g++ could not compile {cpp}:\n{res.stderr[-4000:]}")
        tmp.replace(lib)
    return lib


@cache
def _standard_headers(cxx: tuple[str, ...]) -> Path:
    """A header of the C++ standard headers our headers include, precompiled once with the flags `cxx`.

    Parsing them is about two thirds of compiling one kernel (measured 0.8-1.0 s of 1.1-1.7 s with g++ 12);
    each kernel is compiled with this header included first, so the compiler loads them precompiled. A
    precompiled header the compiler cannot use (other flags, another version) is parsed as plain text instead.
    """
    names = sorted({n for h in HEADERS for n in re.findall(r"^#include <(\w+)>", sources.read(h), re.M)})
    text = "".join(f"#include <{n}>\n" for n in names)
    header = CACHE_DIR / f"std_{hashlib.sha256((text + ' '.join(cxx)).encode()).hexdigest()[:20]}.h"
    gch = header.with_suffix(".h.gch")
    if not gch.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        header.write_text(text)
        tmp = header.with_suffix(f".{id(names)}.tmp")
        flags = [f for f in cxx if f != "-shared"]
        res = subprocess.run([*flags, "-x", "c++-header", str(header), "-o", str(tmp)], capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"g++ could not precompile {header}:\n{res.stderr[-4000:]}")
        tmp.replace(gch)
    return header


@cache
def _load(lib: Path) -> ctypes.CDLL:
    dll = ctypes.CDLL(str(lib))
    dll.run.restype = ctypes.c_bool
    return dll


@cache
def threadgroup_bytes(lib: Path, kname: str) -> int:
    """Threadgroup memory of kernel function `kname` compiled into `lib`: the sizes of its static variables (the
    threadgroup / shared variables made static), each rounded up to 16 bytes, read from the symbol table (nm -S)."""
    res = subprocess.run(["nm", "-S", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    prefixes = (f"_ZZ{len(kname)}{kname}", f"_ZZL{len(kname)}{kname}")  # _ZZ: a function's static variable (L: static)
    sizes = [int(f[1], 16) for f in map(str.split, res.stdout.splitlines())
             if len(f) == 4 and f[3].startswith(prefixes)]
    return sum(-(-size // 16) * 16 for size in sizes)


def launch(name: str, inputs: dict[str, mx.array], outputs: dict[str, tuple[tuple[int, ...], mx.Dtype]],
           grid: tuple[int, int, int], threadgroup: tuple[int, int, int], template: dict[str, int],
           source: str = "cuda") -> list[mx.array]:
    """`build.launch` on CPU threads, from the kernel's CUDA or Metal `source`: grid counts threads (as in MLX);
    threadgroups are (x, 1, 1) with x % 32 == 0, and the grid is one threadgroup wide."""
    threads = threadgroup[0]
    if threadgroup[1:] != (1, 1) or threads % 32 or grid[0] != threads:
        raise ValueError(f"kernel {name}: CPU threads run grids of (threadgroup, y, z) with a threadgroup of "
                         f"(32k, 1, 1); got grid {grid}, threadgroup {threadgroup}")
    for key, arr in inputs.items():
        if arr.dtype not in C_TYPES:
            raise ValueError(f"kernel {name}: input {key} has dtype {arr.dtype}; CPU threads accept "
                             f"{', '.join(str(t) for t in C_TYPES)}")
    if source == "metal":
        kname, text = metal_cpp(name, inputs, outputs, template)
        used = threadgroup_bytes(_library(text), kname)
        if used > METAL_THREADGROUP_BYTES:
            raise RuntimeError(f"kernel {name} ({template}) declares {used} bytes of threadgroup memory; Apple GPUs "
                               f"allow {METAL_THREADGROUP_BYTES} (MLX would fail to build its pipeline)")
    elif source == "cuda":
        args = [(k, C_TYPES[a.dtype], False) for k, a in inputs.items()]
        text = cuda_cpp(name, args + [(k, C_TYPES[dtype], True) for k, (_, dtype) in outputs.items()], template)
        used = threadgroup_bytes(_library(text), "threadgroup")
        if used > CUDA_STATIC_SHARED_BYTES:
            raise RuntimeError(f"kernel {name} ({template}) declares {used} bytes of shared memory; a CUDA thread "
                               f"block allows {CUDA_STATIC_SHARED_BYTES} statically (NVRTC would refuse it)")
    else:
        raise ValueError(f"CPU threads run the {' or '.join(SOURCES)} source, not {source!r}")
    arrays = [np.ascontiguousarray(np.array(a)) for a in inputs.values()]
    # outputs start as nan (or a pattern) so that anything the kernel leaves unwritten shows up
    outs = [np.full(shape, np.nan if dtype in (mx.float32, mx.float16) else 0xDEAD, NP_TYPES[dtype])
            for shape, dtype in outputs.values()]
    pointers = [a.ctypes.data_as(ctypes.c_void_p) for a in arrays + outs]
    finished = _load(_library(text)).run((ctypes.c_void_p * len(pointers))(*pointers), ctypes.c_uint(grid[1]),
                                         ctypes.c_uint(grid[2]), ctypes.c_uint(threads))
    if not finished:
        raise RuntimeError(f"kernel {name} ({source} source) deadlocked: some lanes wait at a barrier or SIMD-group "
                           "operation that others never reach (a branch not all lanes take, or lanes that returned)")
    return [mx.array(o) for o in outs]
