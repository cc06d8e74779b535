"""`gmlx-lab doctor`: what this machine runs the lab on, and whether the fused kernels work on it.

Backend and device, the MLX and mlx-lm versions, each kernel's self-check (passed, failed with the reason, or
not applicable on the CPU) with its time, and on Linux whether OpenBLAS is preloaded for MLX's CPU matmuls.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import mlx.core as mx

from .kernels import active_backend, precompiled, selfcheck


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def openblas_preloaded() -> str | None:
    """Linux: MLX's CPU wheel bundles a slow reference BLAS, and the Makefile preloads Debian's OpenBLAS over it.
    Returns "yes (library)" or "no (...)", None where /proc is not available (not Linux)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    names = {Path(line.split()[-1]).name for line in maps.read_text().splitlines() if "/" in line}
    mapped = sorted(n for n in names if n.startswith(("libopenblas.so", "libopenblasp")))  # not numpy's own copy
    if mapped and "openblas" in os.environ.get("LD_PRELOAD", ""):
        return f"yes ({', '.join(mapped)})"
    return "no (float32 matmuls use MLX's bundled reference BLAS; `make lab`/`make test` preload OpenBLAS)"


def doctor() -> dict[str, Any]:
    """The report as a dict: machine, versions, backend, kernel self-checks, BLAS."""
    backend = active_backend()
    checks = selfcheck.report()
    device = mx.device_info().get("device_name", "") if backend != "cpu" and hasattr(mx, "device_info") else ""
    return {
        "python": platform.python_version(), "platform": platform.platform(),
        "mlx": mx.__version__, "mlx_lm": _version("mlx-lm"), "gmlx_lab": _version("gmlx-lab"),
        "backend": backend, "device": device or platform.processor() or platform.machine(),
        "kernels": None if checks is None else [vars(c) for c in checks],
        "kernel_cache": None if backend != "cuda" else {"folder": str(precompiled.folder()),
                                                         "not_used": precompiled.problems()},
        "openblas_preloaded": openblas_preloaded() if backend == "cpu" and sys.platform.startswith("linux") else None,
    }


def machine_tag() -> str:
    """The machine in a result file's name: "cpu" on MLX's CPU backend, else the GPU's name in short ("h200" for
    an NVIDIA H200, "apple-m3-max"), so results from different machines never share a file."""
    if active_backend() == "cpu":
        return "cpu"
    name = mx.device_info().get("device_name", "") if hasattr(mx, "device_info") else ""
    name = name.lower().removeprefix("nvidia ").strip() or active_backend()
    return "-".join("".join(c if c.isalnum() else " " for c in name).split())


def to_text(report: dict[str, Any]) -> str:
    """The report as lines for a terminal or a notebook."""
    lines = [f"gmlx_lab {report['gmlx_lab']} · MLX {report['mlx']} · mlx-lm {report['mlx_lm']} · "
             f"Python {report['python']}", f"backend: {report['backend']} ({report['device']})"]
    if report["kernels"] is None:
        lines.append("kernels: not applicable on the CPU (the caches use their pure-MLX reference attention; "
                     "`make test` runs the kernels' CUDA and Metal sources on CPU threads)")
    else:
        for c in report["kernels"]:
            state = "passed" if c["passed"] else "FAILED -> reference path"
            lines.append(f"kernel {c['kernel']:14s} {state:26s} {c['seconds']:6.2f} s  {c['reason']}")
    if report.get("kernel_cache"):
        kc = report["kernel_cache"]
        used = "; ".join(f"{k}: {why}" for k, why in kc["not_used"].items()) or "every kernel checked so far"
        lines.append(f"kernel disk cache: {kc['folder']} ({'not used for ' if kc['not_used'] else 'used by '}{used})")
    if report["openblas_preloaded"] is not None:
        lines.append(f"OpenBLAS preloaded: {report['openblas_preloaded']}")
    return "\n".join(lines)
