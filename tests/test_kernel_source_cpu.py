"""The real CUDA source of kvarn_decode, run on CPU threads, against its pure-MLX emulation.

tools/cpu_kernel.py compiles the kernel body with tools/prelude_cpu.h in place of the CUDA prelude (one
thread per GPU lane, warp operations synchronized per warp, the tensor-core fragments multiplied as the PTX
ISA lays them out) and launches it as `kvarn_partials` would. So the kernel's index math, masking, split
bookkeeping and warp merge are checked on every CPU run, not only where a GPU is.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import cpu_kernel  # noqa: E402


def _require_cxx() -> None:
    if shutil.which("g++") is None:
        pytest.fail("g++ (C++20) is needed to run the kernel sources on CPU threads: `bash tools/system_deps.sh` "
                    "installs it (apt-get install g++); on macOS install Xcode's command line tools")


@pytest.mark.parametrize("index", range(len(cpu_kernel.CASES)), ids=lambda i: f"case{i}")
def test_kvarn_decode_source_matches_emulation(index: int) -> None:
    _require_cxx()
    for per_warp in (1, 3):  # 3: a warp's run goes from records on into the sink and recent tiles
        assert cpu_kernel.check_case(index, cpu_kernel.CASES[index], per_warp), (index, per_warp)


def test_the_harness_catches_a_wrong_fragment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose score shuffle reads the wrong lane must fail the comparison (the check is not vacuous)."""
    _require_cxx()
    real = cpu_kernel.build.read

    def broken(name: str) -> str:
        text = real(name)
        return text.replace("simd_shuffle_f(zq, 8u * t + 4u)", "simd_shuffle_f(zq, 8u * t)") if name.endswith(
            ".body") else text

    monkeypatch.setattr(cpu_kernel.build, "read", broken)
    assert "simd_shuffle_f(zq, 8u * t)" in cpu_kernel.cpp_source(
        {"KB": 6, "VB": 6, "S": 1, "NQ": 2, "NCHUNK": 1, "L": 1, "WARPS": 4, "ROTATE": 1, "QDT": 0})
    assert not cpu_kernel.check_case(0, cpu_kernel.CASES[0], 1)
