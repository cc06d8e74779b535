"""The Metal sources on CPU threads: the text MLX compiles, the shim's meaning of Metal, and that it catches slips.

The `gpu` tests of test_kernels.py run every kernel from its Metal source too (tests/conftest.py); these tests
check what makes those runs faithful.
"""

from __future__ import annotations

import os
import re
import sys

import mlx.core as mx
import pytest
from conftest import random_kv
from test_kernels import KERNEL_TOL, _affine_cache, _affine_dequantized_reference, _kvarn_cache, _on_cpu, _rel

from gmlx_lab.kernels import KERNELS, assemble, build, decode, seal_records, threads
from gmlx_lab.kernels.decode import group_queries, kvarn_partials, merge_splits


def _launches(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple]:
    """The first launch of each kernel in small real uses (kvarn and affine decode, merge, seal), as
    build.launch hands it to the Metal runner."""
    seen: dict[str, tuple] = {}
    real = threads.launch

    def record(name, inputs, outputs, grid, threadgroup, template, source="cuda"):
        seen.setdefault(name, (inputs, outputs, grid, threadgroup, template))
        return real(name, inputs, outputs, grid, threadgroup, template, source=source)

    monkeypatch.setattr(threads, "launch", record)
    with _on_cpu(), threads.on_cpu_threads("metal"):
        c = _kvarn_cache(128, 2, 4, 4, 128 + 2 * 128 + 5, 0, seed=1)
        c.attention_path = "fused"
        c.attend(mx.random.normal((1, 4, 1, 128)), 0.1, None)
        a = _affine_cache(4, 64, 128, 128 + 7, seed=1)
        a.attention_path = "fused"
        a.attend(mx.random.normal((1, 4, 1, 128)), 0.1, None)
        k, _ = random_kv(128, 1, 128)
        seal_records(mx.hadamard_transform(k).astype(mx.float16), 4, "k", iters=1)
    assert set(seen) == set(KERNELS)
    return seen


def _mlx_source(name: str, inputs: dict, outputs: dict, grid: tuple, threadgroup: tuple, template: dict,
                tmp_path, capfd: pytest.CaptureFixture) -> str:
    """The source mx.fast.metal_kernel itself generates: exporting a function traces the kernel without running
    it (no Metal needed), and verbose=True prints the source."""
    header, source = assemble(name, "metal")
    kernel = mx.fast.metal_kernel(name=f"gmlx_{name}", input_names=list(inputs), output_names=list(outputs),
                                  source=source, header=header, ensure_row_contiguous=True)

    def f(*arrays):
        return kernel(inputs=list(arrays), template=list(template.items()), grid=grid, threadgroup=threadgroup,
                      output_shapes=[s for s, _ in outputs.values()], output_dtypes=[d for _, d in outputs.values()],
                      verbose=True)

    capfd.readouterr()
    mx.export_function(os.fspath(tmp_path / f"{name}.mlxfn"), f, *inputs.values())
    printed = capfd.readouterr().out
    return re.search(r"```\n(.*)\n```", printed, re.S).group(1)


def test_metal_source_is_what_mlx_generates(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                            capfd: pytest.CaptureFixture) -> None:
    """build.metal_source writes, character for character, the text MLX 0.32.4 compiles for each kernel; with
    small inputs too (the `constant` address space and a `c` in the kernel's name)."""
    for name, (inputs, outputs, grid, threadgroup, template) in _launches(monkeypatch).items():
        want = _mlx_source(name, inputs, outputs, grid, threadgroup, template, tmp_path, capfd)
        assert build.metal_source(name, inputs, outputs, template)[1] == want, name
    small = {"part_o": mx.zeros((1, 1, 4, 128)), "part_lse": mx.zeros((1, 1, 4)), "params": mx.array([1], mx.int32)}
    outputs = {"out": ((1, 4, 128), mx.float16), "lse": ((1, 4), mx.float32)}
    template = {"D": 128, "NQ": 4, "ROTATE": 1, "ODT": 1}
    kname, text = build.metal_source("split_merge", small, outputs, template)
    assert text == _mlx_source("split_merge", small, outputs, (128, 4, 1), (128, 1, 1), template, tmp_path, capfd)
    assert "const constant float* part_lse [[buffer(1)]]" in text and kname.endswith("_floatc_int32_tc_float16_t_float")


def test_threadgroup_variables_become_static() -> None:
    """Threadgroup storage is one copy per threadgroup: `static` (threadgroups run in turn); a `threadgroup`
    qualifying a pointer or a cast stays, for the shim to define as nothing."""
    text = ("threadgroup float q_sh[8 * D];\nthreadgroup float m_sh[4], l_sh[4];\nthreadgroup float4 q4[QB * D / 4];\n"
            "threadgroup float* pw = p_sh + 4;\nconst float2 pa = *(threadgroup float2*)(pw + 2);\n"
            "void f(threadgroup const float* x);\n")
    assert threads.threadgroup_storage_static(text) == text.replace("threadgroup float q_sh", "static float q_sh") \
        .replace("threadgroup float m_sh", "static float m_sh").replace("threadgroup float4", "static float4")


def test_metal_address_spaces_are_kept_apart() -> None:
    """MLX passes an input of fewer than 8 elements in the `constant` address space; split_merge points a
    `const device` pointer into part_lse, which Metal refuses for such a small one, and so does the shim.
    build.launch pads small inputs for Metal, so the merge runs and matches its emulation."""
    po, pl = mx.random.normal((1, 1, 4, 128)), mx.random.normal((1, 1, 4))
    with pytest.raises(RuntimeError, match=r"invalid conversion from .const volatile float\*. to .const float\*."):
        threads.launch("split_merge", {"part_o": po, "part_lse": pl, "params": mx.array([1], mx.int32)},
                       {"out": ((1, 4, 128), mx.float32), "lse": ((1, 4), mx.float32)}, (128, 4, 1), (128, 1, 1),
                       {"D": 128, "NQ": 4, "ROTATE": 0, "ODT": 0}, source="metal")
    with _on_cpu(), threads.on_cpu_threads("metal"):
        o, lse = merge_splits(po, pl)
    eo, el = merge_splits(po, pl, emulate=True)
    assert _rel(o, eo) < 1e-5 and mx.allclose(lse, el).item()


@pytest.mark.skipif(sys.platform != "linux", reason="the runner reads symbol sizes from ELF libraries (nm -S)")
def test_metal_threadgroup_memory_fits_apple_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Apple GPUs give a threadgroup 32 KB. The runner refuses a Metal kernel that declares more (affine_decode
    with 4 query vectors of head_dim 1024: 35 KB), and decode.py picks 3 there (2 warps for kvarn past 256)."""
    c = _affine_cache(4, 128, 1024, 128 + 5, seed=0)
    q = mx.random.normal((1, 4, 2, 1024))
    c.attention_path = "fused"
    with _on_cpu(), threads.on_cpu_threads("metal"):
        assert decode.affine_qb_max(1024) == 3 and decode.kvarn_warps(512) == 2 and decode.kvarn_warps(256) == 4
        out = c.attend(q, 1024**-0.5, "causal")
        monkeypatch.setattr(decode, "affine_qb_max", lambda d: 4)
        with pytest.raises(RuntimeError, match="35008 bytes of threadgroup memory; Apple GPUs allow 32768"):
            c.attend(q, 1024**-0.5, "causal")
    assert _rel(out, _affine_dequantized_reference(c, q, "causal")) < 2e-3


def test_metal_mma_slip_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Metal prelude's mma16816 runs as written: with one SIMD shuffle reading the wrong lane (column 2t's
    B values fetched for column 2t+1), kvarn_decode from its Metal source fails against the emulation."""
    c = _kvarn_cache(128, 2, 6, 6, 128 + 3 * 128 + 77, 128, seed=0)
    qg = group_queries(mx.random.normal((1, 4, 1, 128)), 2)
    eo, _ = kvarn_partials(qg, 0.1, c, 1, False, per_warp=1, emulate=True)
    real = build.read
    right, wrong = "simd_shuffle(b[h], ushort(8 * t + 4 + src))", "simd_shuffle(b[h], ushort(8 * t + src))"
    assert right in real("prelude_metal.h")
    with _on_cpu(), threads.on_cpu_threads("metal"):
        good, _ = kvarn_partials(qg, 0.1, c, 1, False, per_warp=1)
        monkeypatch.setattr(build, "read", lambda name: real(name).replace(right, wrong))
        bad, _ = kvarn_partials(qg, 0.1, c, 1, False, per_warp=1)
    assert _rel(good, eo) < KERNEL_TOL and _rel(bad, eo) > 0.1


@pytest.mark.parametrize("source", threads.SOURCES)
def test_cpu_threads_report_a_deadlock(monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """A barrier that only some lanes reach (here lane 0 of each SIMD group, in split_merge) stops the launch
    with an error instead of hanging: no lane arrives anywhere during a whole turn of the waiting lanes."""
    real = build.read
    slip = lambda name: real(name).replace("BARRIER();\nbig = red[0];", "if (LANE == 0) BARRIER();\nbig = red[0];")  # noqa: E731
    monkeypatch.setattr(build, "read", slip)
    monkeypatch.setattr(threads, "read", slip)
    with _on_cpu(), threads.on_cpu_threads(source), pytest.raises(RuntimeError, match="deadlocked"):
        merge_splits(mx.random.normal((1, 2, 4, 128)), mx.random.normal((1, 2, 4)))


@pytest.mark.parametrize("source", threads.SOURCES)
def test_cpu_lanes_on_ucontext(monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """cpu_lanes.h switches fibers by ucontext where it has no x86-64 switch; -DGMLX_UCONTEXT builds that here."""
    monkeypatch.setattr(threads, "CXX", [*threads.CXX, "-DGMLX_UCONTEXT"])
    po, pl = mx.random.normal((2, 5, 4, 128)), mx.random.normal((2, 5, 4))
    with _on_cpu(), threads.on_cpu_threads(source):
        o, lse = merge_splits(po, pl, rotate=True)
    eo, el = merge_splits(po, pl, rotate=True, emulate=True)
    assert _rel(o, eo) < 1e-5 and mx.allclose(lse, el).item()


def test_cpu_threads_refuse_an_unknown_source() -> None:
    with pytest.raises(ValueError, match="cuda or metal"):
        with threads.on_cpu_threads("vulkan"):
            pass
    with pytest.raises(RuntimeError, match="on_cpu_threads"):
        threads.current_source()
