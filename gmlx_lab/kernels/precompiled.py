"""CUDA kernels compiled once per machine instead of once per process: NVRTC's cubin of each kernel text and
template constants, kept in a folder on disk and launched through mx.fast.precompiled_cuda_kernel.

MLX 0.32 compiles a custom kernel (mx.fast.cuda_kernel) with NVRTC in every process, once per set of template
constants, and keeps the result in memory only, so each new process paid the compiles of every kernel variant
again (docs/history/gpu-rounds.md, "First use"). Here the same text (the CUDA prelude, common.h, the
kernel's helpers and body, as `sources.assemble` gives them; `kernel_text` adds the signature MLX would write)
goes to NVRTC, the library MLX itself compiles with, and the cubin is stored as
    <folder>/mlx-<MLX version>/<arch>/<kernel>/<key>.cubin
where `key` hashes the whole text (template constants and argument types included), the arch, and MLX's and
NVRTC's versions. The folder: `kernels` in gmlx_lab's user cache (paths.cache_root: $GMLX_LAB_CACHE, else
$XDG_CACHE_HOME/gmlx_lab, else ~/.cache/gmlx_lab). The setting `kernel_cache` (config.py) turns it off.

How the binary reaches MLX: handed to MLX's own module cache (`handed`). MLX looks for every CUDA module it
builds, custom kernels included, as a file `<module name>.ptx` (with a `.txt` of kernel names) in its PTX folder
before compiling (mlx/backend/cuda/jit_module.cpp, v0.32); a custom kernel's module name is its function name and
std::hash of the text MLX writes around the kernel's body. So the cubin is written there under that name and the
kernel is launched with mx.fast.cuda_kernel, which then loads it instead of compiling. The other way,
mx.fast.precompiled_cuda_kernel, hashes the whole cubin (129 KB for kvarn_decode, against MLX's 27 KB of text) at
every launch, a cost a layer of every decode step (docs/history/gpu-rounds.md). A probe kernel
checks once per process that MLX reads what is handed to it (`handoff_works`); where it does not, `launch` uses
precompiled_cuda_kernel, and says so.

Whatever fails (no NVRTC library, a compile error, a folder that cannot be written) makes `build.launch` use
mx.fast.cuda_kernel as before, and is said once per kernel: a RuntimeWarning, and `problems()`, which the
policy's [kv] line, the caches' `attention_route()` and `gmlx-lab doctor` show.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import sys
import warnings
from functools import cache
from pathlib import Path

import mlx.core as mx

from ..paths import cache_root
from .sources import assemble, compact, cuda_name

# C types of the kernels' arguments: those of MLX's `dtype_to_cuda_type`, spelled with built-in names (the
# CUDA prelude includes no <cstdint>); a pointer's type is all that reaches the launch.
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.uint32: "unsigned int",
              mx.int32: "int", mx.uint8: "unsigned char", mx.int8: "signed char", mx.uint16: "unsigned short",
              mx.int16: "short", mx.uint64: "unsigned long long", mx.int64: "long long", mx.bool_: "bool"}
# MLX's own text starts with its device utilities, which bring these: the float16/bfloat16 types and the
# fixed-width integers (NVRTC has no <cstdint> of its own; the bodies name uint32_t).
INCLUDES = ("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"
            "typedef signed char int8_t; typedef unsigned char uint8_t; typedef short int16_t;\n"
            "typedef unsigned short uint16_t; typedef int int32_t; typedef unsigned int uint32_t;\n"
            "typedef long long int64_t; typedef unsigned long long uint64_t;\n")
ELF_MAGIC = b"\x7fELF"

Signature = tuple[tuple[str, mx.Dtype], ...]  # (argument name, dtype) in launch order


def folder() -> Path:
    """Where compiled kernels are kept (see the module docstring); read at each call, so tests can point it."""
    return cache_root() / "kernels"


def kernel_text(function: str, name: str, inputs: Signature, outputs: Signature, template: dict[str, int]) -> str:
    """The CUDA text NVRTC compiles for kernel `name`: its header and body as mx.fast.cuda_kernel gets them,
    in a function signature written here.

    Why a signature of our own: mx.fast.cuda_kernel writes `__global__ void f(const T* in..., T* out...)` around
    the body, with the template constants as `constexpr int` lines, and keeps that text inside MLX; a
    precompiled kernel is called with the same arguments (input pointers, then output pointers) but its binary
    must come with its entry point, so this writes that signature the way MLX does (MLX 0.32.4's
    `build_kernel`, custom_kernel.cpp), `extern "C"` so the entry point keeps its name. No body in this folder
    reads `<input>_shape`/`_strides`/`_ndim`, which MLX would add as arguments (`launch` refuses such a body)."""
    header, source = (compact(text) for text in assemble(name, "cuda"))
    for arg, _ in inputs:
        if any(arg + suffix in source for suffix in ("_shape", "_strides", "_ndim")):
            raise ValueError(f"kernel {name}: its body reads {arg}'s shape; a precompiled launch passes no shapes")
    return kernel_text_of(function, header, source, inputs, outputs, template)


def kernel_text_of(function: str, header: str, source: str, inputs: Signature, outputs: Signature,
                   template: dict[str, int]) -> str:
    """kernel_text for a given header and body."""
    args = [f"    const {CUDA_TYPES[dtype]}* {arg}" for arg, dtype in inputs]
    args += [f"    {CUDA_TYPES[dtype]}* {arg}" for arg, dtype in outputs]
    constants = "".join(f"  constexpr int {k} = {int(v)};\n" for k, v in template.items())
    return (INCLUDES + header + f'extern "C" __global__ void {function}(\n' + ",\n".join(args) + ") {\n"
            + constants + source + "}\n")


def cache_key(text: str, arch: str, mlx_version: str, nvrtc_version: str) -> str:
    """The file name (without suffix) of a compiled text: what decides the binary, hashed."""
    return hashlib.sha256("\0".join((text, arch, mlx_version, nvrtc_version)).encode()).hexdigest()[:32]


def cubin_path(root: Path, mlx_version: str, arch: str, name: str, key: str) -> Path:
    """Where the cubin of kernel `name` with `key` lives under `root`."""
    return root / f"mlx-{mlx_version}" / arch / name / f"{key}.cubin"


def arch_of(major: int, minor: int) -> str:
    """NVRTC's --gpu-architecture for a compute capability, as MLX picks it: sm_XY, with the arch-specific
    features ('a') from 9.0 on (the H200 is sm_90a)."""
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def nvrtc_candidates() -> list[str]:
    """Paths or names of NVRTC libraries to try, best first: the one already in this process (MLX's CUDA backend
    links it); the `nvidia-cuda-nvrtc` wheels on sys.path; the system's ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda)."""
    found: list[str] = []
    maps = Path("/proc/self/maps")
    if maps.exists():
        for line in maps.read_text().splitlines():
            path = line.split()[-1]
            if "/libnvrtc.so" in path and path not in found:
                found.append(path)
    for entry in sys.path:
        for sub in ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"):
            if (Path(entry) / sub).exists():
                found.append(str(Path(entry) / sub))
    system = ctypes.util.find_library("nvrtc")
    return found + ([system] if system else [])


def include_dirs(nvrtc_path: str) -> list[str]:
    """Folders holding cuda_fp16.h for NVRTC: beside the library (the wheels' nvidia/cu13/include), then
    $CUDA_HOME, $CUDA_PATH and /usr/local/cuda, as MLX looks for them."""
    roots = [Path(nvrtc_path).resolve().parent.parent] if "/" in nvrtc_path else []
    roots += [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)] + [Path("/usr/local/cuda")]
    return [str(r / "include") for r in roots if (r / "include" / "cuda_fp16.h").exists()]


class Nvrtc:
    """The few NVRTC calls a compile needs, through ctypes."""

    def __init__(self, path: str):
        self.path = path
        if "/" in path:  # NVRTC opens its builtins library by name: one beside it, loaded first, is the one found
            for builtins in sorted(Path(path).parent.glob("libnvrtc-builtins.so.*")):
                if ".alt." not in builtins.name:
                    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(path)
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = f"{major.value}.{minor.value}"
        self.includes = include_dirs(path)

    def _check(self, status: int, what: str) -> None:
        if status:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def compile(self, text: str, arch: str, filename: str) -> bytes:
        """The cubin of `text` for `arch` (MLX's options: device code by default; the CUDA headers found)."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), filename.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            opts = [f"--gpu-architecture={arch}", "--device-as-default-execution-space"]
            opts += [f"--include-path={d}" for d in self.includes]
            argv = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
            status = self.lib.nvrtcCompileProgram(prog, len(opts), argv)
            if status:
                size = ctypes.c_size_t()
                self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                self.lib.nvrtcGetProgramLog(prog, log)
                raise RuntimeError(f"NVRTC could not compile {filename}: {log.value.decode(errors='replace')[-1500:]}")
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


@cache
def nvrtc() -> Nvrtc:
    """The first NVRTC library of `nvrtc_candidates` that loads; RuntimeError naming what was tried."""
    tried = []
    for candidate in nvrtc_candidates():
        try:
            return Nvrtc(candidate)
        except (OSError, AttributeError, RuntimeError) as exc:
            tried.append(f"{candidate} ({exc})")
    raise RuntimeError("no NVRTC library found (tried: " + ("; ".join(tried) or "none: no libnvrtc in this process, "
                       "on sys.path's nvidia/ wheels or the system") + "); install nvidia-cuda-nvrtc or set CUDA_HOME")


@cache
def device_arch() -> str:
    """This GPU's NVRTC arch, from MLX's device info."""
    info = mx.device_info()
    return arch_of(int(info["compute_capability_major"]), int(info["compute_capability_minor"]))


_problems: dict[str, str] = {}  # kernel -> why it went back to mx.fast.cuda_kernel (said once)
_unstored: dict[str, str] = {}  # kernel -> why its NVRTC build could not be kept on disk (said once)
_not_handed: dict[str, str] = {}  # kernel (or the probe) -> why its binary is not run from MLX's module cache


def problems() -> dict[str, str]:
    """Kernels compiled again in each process (their build not kept on disk), or launched the slower way
    (precompiled_cuda_kernel), and why, in this process so far."""
    return {**_not_handed, **_unstored, **_problems}


def note() -> str:
    """Those kernels in a line for the [kv] line and attention_route(), '' when there were none."""
    compiled = "; ".join(f"{k}: {reason}" for k, reason in {**_unstored, **_problems}.items())
    slower = "; ".join(f"{k}: {reason}" for k, reason in _not_handed.items())
    parts = [f"compiled in each process, no kernel disk cache ({compiled})"] if compiled else []
    parts += [f"a slower launch, binary not handed to MLX ({slower})"] if slower else []
    return "; ".join(parts)


def not_handed(name: str, why: str) -> None:
    """Record that kernel `name` (or the probe, for all) launches with precompiled_cuda_kernel, and say so once."""
    if name not in _not_handed:
        _not_handed[name] = why
        warnings.warn(f"gmlx_lab kernel {name}: {why}; launched with mx.fast.precompiled_cuda_kernel instead "
                      "(same results, more host time a decode layer)", RuntimeWarning, stacklevel=3)


def give_up(name: str, why: str, fallback: bool = True) -> None:
    """Record that kernel `name` compiles in each process, and say so the first time. `fallback`: it goes
    back to mx.fast.cuda_kernel (else NVRTC's build is used in this process but could not be kept)."""
    if name in _problems or name in _unstored:
        return
    if fallback:
        _problems[name] = why
    else:
        _unstored[name] = why
    then = ("it is compiled by mx.fast.cuda_kernel in each process instead" if fallback
            else "it is compiled again in each process")
    warnings.warn(f"gmlx_lab kernel {name}: no disk-cached build ({why}); {then} (slower first use, same results)",
                  RuntimeWarning, stacklevel=3)


def forget() -> None:
    """Drop the binaries held in memory and the fallbacks seen (tests; after editing a kernel's source)."""
    binary.cache_clear()
    handed.cache_clear()
    handoff_works.cache_clear()
    _problems.clear()
    _unstored.clear()
    _not_handed.clear()


def store(path: Path, cubin: bytes) -> None:
    """Write a cubin as a whole file (other processes may read the folder meanwhile)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_bytes(cubin)
    os.replace(partial, path)


@cache
def binary(name: str, inputs: Signature, outputs: Signature, template: tuple[tuple[str, int], ...]
           ) -> tuple[str, bytes] | None:
    """(entry point, cubin) of kernel `name` for these argument types and template constants: read from the
    folder, else compiled and written there; None (said once) when it cannot be had, and the caller compiles the
    text with mx.fast.cuda_kernel. Once per process and variant: a decode step finds it in memory."""
    if name in _problems:
        return None
    function = cuda_name(name)
    try:
        compiler, arch = nvrtc(), device_arch()
        text = kernel_text(function, name, inputs, outputs, dict(template))
        path = cubin_path(folder(), mx.__version__, arch, name, cache_key(text, arch, mx.__version__, compiler.version))
        cubin = path.read_bytes() if path.exists() else b""
        if cubin[:4] == ELF_MAGIC:
            return function, cubin
        cubin = compiler.compile(text, arch, f"{function}.cu")
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        give_up(name, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}")
        return None
    try:
        store(path, cubin)
    except OSError as exc:  # this process still runs the cubin; the next one compiles again
        give_up(name, f"cannot write {path.parent} ({exc.strerror or exc})", fallback=False)
    return function, cubin


# -- handing a binary to MLX's own module cache ----------------------------------------------------------------
# What MLX 0.32 writes around a custom kernel (custom_kernel.cpp, build_kernel): its device utilities first, the
# kernel in its namespace, and these type names (utils.cpp, dtype_to_cuda_type).
MLX_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
MLX_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.uint32: "uint32_t",
             mx.int32: "int32_t", mx.uint8: "uint8_t", mx.int8: "int8_t", mx.uint16: "uint16_t", mx.int16: "int16_t",
             mx.uint64: "uint64_t", mx.int64: "int64_t", mx.bool_: "bool"}
WORD = 0xFFFFFFFFFFFFFFFF
HASH_MUL = (0xC6A4A793 << 32) + 0x5BD1E995  # libstdc++'s _Hash_bytes (hash_bytes.cc, 64-bit size_t)
HASH_SEED = 0xC70F6907  # std::hash<std::string>'s seed


def std_hash(data: bytes) -> int:
    """std::hash<std::string> of libstdc++ (its `_Hash_bytes`), which MLX uses to name a custom kernel's module."""
    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)
    n = len(data)
    whole = n & ~7
    h = HASH_SEED ^ ((n * HASH_MUL) & WORD)
    for i in range(0, whole, 8):
        h = ((h ^ ((shift_mix((int.from_bytes(data[i:i + 8], "little") * HASH_MUL) & WORD) * HASH_MUL) & WORD))
             * HASH_MUL) & WORD
    if n & 7:
        h = ((h ^ int.from_bytes(data[whole:], "little")) * HASH_MUL) & WORD
    return shift_mix((shift_mix(h) * HASH_MUL) & WORD)


def mlx_kernel_name(function: str, template: tuple[tuple[str, int], ...]) -> str:
    """The name MLX gives the kernel that mx.fast.cuda_kernel(name=function) runs with these template constants."""
    return "custom_kernel_" + function + "".join(f"_{int(v)}" for _, v in template)


def mlx_text(kernel_name: str, header: str, source: str, inputs: Signature, outputs: Signature,
             template: tuple[tuple[str, int], ...]) -> str:
    """The text mx.fast.cuda_kernel builds (and hashes) for a kernel whose body reads no shapes."""
    args = [f"    const {MLX_TYPES[dtype]}* {arg},\n" for arg, dtype in inputs]
    args += [f"    {MLX_TYPES[dtype]}* {arg}" for arg, dtype in outputs]
    constants = "".join(f"  constexpr int {k} = {int(v)};\n" for k, v in template) + ("\n" if template else "")
    return (MLX_DEFAULT_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void {kernel_name}(\n" + "".join(args[:len(inputs)]) + ",\n".join(args[len(inputs):])
            + ") {\n" + constants + source + "\n}\n\n} // namespace mlx::core::cu\n")


def mlx_module_folder() -> Path:
    """MLX's PTX folder: $MLX_PTX_CACHE_DIR, else C++'s temp directory (TMPDIR, TMP, TEMP, TEMPDIR, /tmp) with
    mlx/<version>/ptx (jit_module.cpp, ptx_cache_dir)."""
    if os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(os.environ["MLX_PTX_CACHE_DIR"])
    temp = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if os.environ.get(v)), "/tmp")
    return Path(temp) / "mlx" / mx.__version__ / "ptx"


def hand_over(kernel_name: str, text: str, function: str, cubin: bytes) -> Path:
    """Write `cubin` (entry point `function`) where MLX looks for the module of `text`; returns the file."""
    path = mlx_module_folder() / f"{kernel_name}_{std_hash(text.encode()):x}.ptx"
    if not path.exists() or path.read_bytes() != cubin:
        # the kernel names first: MLX reads the .txt after finding the .ptx
        store(path.with_suffix(".txt"), f"mlx::core::cu::{kernel_name}\t{function}\n".encode())
        store(path, cubin)
    return path


PROBE_INPUTS: Signature = (("x", mx.uint32),)
PROBE_OUTPUTS: Signature = (("out", mx.uint32),)
PROBE_BODY = "  out[0] = x[0] + {}u;\n"


@cache
def handoff_works() -> bool:
    """Whether MLX runs a binary handed to its module cache: a probe kernel whose text adds 1 is handed a binary
    that adds 2 (compiled once per machine). Said once when it does not; `launch` then uses precompiled_cuda_kernel."""
    function = f"gmlx_handoff_probe_{hashlib.sha256(mx.__version__.encode()).hexdigest()[:8]}"
    template = (("PROBE", 1),)
    try:
        compiler, arch = nvrtc(), device_arch()
        text = kernel_text_of(function, "", PROBE_BODY.format(2), PROBE_INPUTS, PROBE_OUTPUTS, dict(template))
        path = cubin_path(folder(), mx.__version__, arch, "handoff_probe",
                          cache_key(text, arch, mx.__version__, compiler.version))
        cubin = path.read_bytes() if path.exists() else b""
        if cubin[:4] != ELF_MAGIC:
            cubin = compiler.compile(text, arch, f"{function}.cu")
            store(path, cubin)
        mlx_name = mlx_kernel_name(function, template)
        hand_over(mlx_name, mlx_text(mlx_name, "", PROBE_BODY.format(1), PROBE_INPUTS, PROBE_OUTPUTS, template),
                  function, cubin)
        kernel = mx.fast.cuda_kernel(name=function, input_names=["x"], output_names=["out"],
                                     source=PROBE_BODY.format(1))
        out = kernel(inputs=[mx.array([40], mx.uint32)], template=list(template), grid=(1, 1, 1),
                     threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.uint32])[0]
        result = int(out.item())
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        not_handed("handoff_probe", f"the probe failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}")
        return False
    if result != 42:
        not_handed("handoff_probe", f"MLX compiled the probe's text instead of loading the binary handed to it in "
                   f"{mlx_module_folder()} (got {result}, not 42)")
        return False
    return True


@cache
def handed(name: str, inputs: Signature, outputs: Signature, template: tuple[tuple[str, int], ...]) -> bool:
    """Whether kernel `name` with these types and constants now runs from MLX's module cache when launched with
    mx.fast.cuda_kernel (its binary handed over; once per process and variant)."""
    found = binary(name, inputs, outputs, template)
    if found is None or not handoff_works():
        return False
    function, cubin = found
    header, source = (compact(text) for text in assemble(name, "cuda"))
    mlx_name = mlx_kernel_name(function, template)
    try:
        hand_over(mlx_name, mlx_text(mlx_name, header, source, inputs, outputs, template), function, cubin)
    except OSError as exc:
        not_handed(name, f"cannot write {mlx_module_folder()} ({exc.strerror or exc})")
        return False
    return True
