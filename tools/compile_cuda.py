"""Compile a kernel's CUDA source without a GPU: NVRTC to PTX, then ptxas for registers, spills and memory.

The source is assembled as `mx.fast.cuda_kernel` assembles it (header, then a __global__ function with
the inputs, outputs and template constants, then the body), so errors and register counts here are the
ones the H200 sees. Needs NVRTC and ptxas, e.g. `pip install nvidia-cuda-nvrtc nvidia-cuda-nvcc
nvidia-cuda-runtime nvidia-cuda-crt` into any environment, and that environment's path as --cuda.
Usage: python tools/compile_cuda.py kvarn_decode --cuda /tmp/cudatools --set KB=6 VB=6 S=1 ...
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gmlx_lab.kernels.sources import assemble  # noqa: E402

# (name, CUDA type) of each kernel's inputs and outputs, in the order gmlx_lab passes them
SIGNATURES = {
    "kvarn_decode": (
        [("q", "__half"), ("kc", "uint32_t"), ("ks", "__half"), ("kz", "__half"), ("ko", "__half"),
         ("vc", "uint32_t"), ("vs", "__half"), ("vz", "__half"), ("vo", "__half"), ("sk", "__half"),
         ("sv", "__half"), ("rk", "__half"), ("rv", "__half"), ("params", "int32_t"), ("fparams", "float"),
         ("counter", "uint32_t")],
        [("part_o", "float"), ("part_lse", "float"), ("out", "__half"), ("counter_out", "uint32_t")]),
    "split_merge": (
        [("part_o", "float"), ("part_lse", "float"), ("params", "int32_t")], [("out", "__half"), ("lse", "float")]),
    "affine_decode": (
        [("q", "__half"), ("kw", "uint32_t"), ("ksc", "__half"), ("kbi", "__half"), ("vw", "uint32_t"),
         ("vsc", "__half"), ("vbi", "__half"), ("params", "int32_t"), ("fparams", "float")],
        [("part_o", "float"), ("part_lse", "float")]),
}


def source(name: str, template: dict[str, int]) -> str:
    header, body = assemble(name, "cuda")
    inputs, outputs = SIGNATURES[name]
    args = [f"    const {t}* {n}" for n, t in inputs] + [f"    {t}* {n}" for n, t in outputs]
    consts = "".join(f"  constexpr int {k} = {v};\n" for k, v in template.items())
    prefix = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\ntypedef unsigned int uint32_t;\ntypedef int int32_t;\n"
    signature = f"\n__global__ void gmlx_{name}(\n" + ",\n".join(args) + ") {\n"
    return prefix + header + signature + consts + body + "\n}\n"


def nvrtc_ptx(text: str, cuda: Path, arch: str) -> str:
    lib = ctypes.CDLL(str(next(cuda.glob("lib/python3*/site-packages/nvidia/cu*/lib/libnvrtc.so*"))))
    include = next(cuda.glob("lib/python3*/site-packages/nvidia/cu*/include"))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"kernel.cu", 0, None, None):
        raise SystemExit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), f"-I{include}".encode(), b"--std=c++17", b"-default-device"]
    status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if status:
        raise SystemExit(f"NVRTC failed:\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=sorted(SIGNATURES))
    ap.add_argument("--cuda", type=Path, required=True, help="environment holding the nvidia NVRTC/nvcc wheels")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--set", nargs="*", default=[], help="template constants, NAME=VALUE")
    ap.add_argument("--ptx", type=Path, help="also write the PTX here")
    args = ap.parse_args()
    template = {k: int(v) for k, v in (x.split("=") for x in args.set)}
    ptx = nvrtc_ptx(source(args.kernel, template), args.cuda, f"compute_{args.arch.split('_')[1]}")
    out = args.ptx or Path(f"/tmp/{args.kernel}.ptx")
    out.write_text(ptx)
    ptxas = next(args.cuda.glob("lib/python3*/site-packages/nvidia/cu*/bin/ptxas"))
    res = subprocess.run([str(ptxas), "-v", f"-arch={args.arch}", str(out), "-o", "/dev/null"],
                         capture_output=True, text=True)
    print(res.stdout + res.stderr)
    sys.exit(res.returncode)


if __name__ == "__main__":
    main()
