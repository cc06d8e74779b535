"""Kernels check themselves on first use on a GPU, and a failure falls back loudly; `gmlx-lab doctor` shows it."""

import subprocess
import sys
import warnings

import mlx.core as mx
import pytest
from conftest import random_kv, tiny_llama

import gmlx_lab
import gmlx_lab.cache.kernel_route as kernel_route
from gmlx_lab.doctor import doctor, to_text
from gmlx_lab.kernels import active_backend, selfcheck, sources, threads


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(selfcheck.CHECKS))
def test_each_kernel_passes_its_self_check(name):
    """On a GPU: the check itself; on CPU threads: the same cases from the CUDA and Metal sources."""
    assert selfcheck.CHECKS[name]() < selfcheck.TOLERANCE


def test_a_failed_self_check_falls_back_loudly(monkeypatch):
    """kvarn_decode with one wrong shuffle lane fails its check: a warning, the [kv] line, the cache's route, and
    the reference attention (same as an unbroken cache's reference) instead of wrong numbers."""
    model = tiny_llama(layers=2)
    for module in (selfcheck, kernel_route):  # pretend MLX runs on a GPU; the kernels then run on CPU threads
        monkeypatch.setattr(module, "active_backend", lambda: "cuda")
    real = sources.read

    def slipped(name: str) -> str:
        return real(name).replace("simd_shuffle_f(zq, 8u * t + 4u)", "simd_shuffle_f(zq, 8u * t)")

    # the slip in the text a real GPU compiles and CPU threads run alike (the CUDA name follows the text)
    monkeypatch.setattr(sources, "read", slipped)
    selfcheck.reset()
    try:
        with threads.on_cpu_threads("cuda"), pytest.warns(RuntimeWarning, match="kvarn_decode failed its self-check"):
            cache = gmlx_lab.make_cache(model, "kvarn", bits=4, kv_tail_tokens=0, quiet=True)
        assert "kvarn_decode failed its self-check (relative error" in str(cache.policy)
        assert cache.policy.as_dict()["kernel_fallbacks"].keys() == {"kvarn_decode"}
        assert "reference for kvarn_decode" in cache[0].attention_route()
        k, v = random_kv(400, heads=2)
        with threads.on_cpu_threads("cuda"), warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once per process, not per call
            kk, vv = cache[0].update_and_fetch(k, v)
            cache[0].update_and_fetch(k[:, :, :1], v[:, :, :1])
            kk, vv = cache[0].fetch(mx.float32)
            q = mx.random.normal((1, 4, 1, 128))
            out = cache[0].attend(q, kk, vv, scale=0.1, mask=None)
        assert cache[0].n_records > 0
        ref = mx.fast.scaled_dot_product_attention(q, kk, vv, scale=0.1, mask=None)
        assert mx.allclose(out, ref, atol=1e-5).item()
        cache[0].attention_path = "fused"
        with threads.on_cpu_threads("cuda"), pytest.raises(RuntimeError, match="failed its self-check"):
            cache[0].attend(q, kk, vv, scale=0.1, mask=None)
    finally:
        selfcheck.reset()


def test_doctor_reports_the_machine():
    report = doctor()
    text = to_text(report)
    assert report["mlx"] == mx.__version__ and report["backend"] == active_backend()
    if active_backend() == "cpu":
        assert report["kernels"] is None and "not applicable on the CPU" in text
    else:
        assert {k["kernel"] for k in report["kernels"]} == set(selfcheck.CHECKS)
    if active_backend() == "cuda":  # every kernel the checks ran came from the disk cache (kernels/precompiled.py)
        assert report["kernel_cache"]["not_used"] == {} and "kernel disk cache: " in text
    else:
        assert report["kernel_cache"] is None
    out = subprocess.run([sys.executable, "-m", "gmlx_lab.cli", "doctor"], capture_output=True, text=True)
    assert out.returncode == 0 and "backend:" in out.stdout, out.stderr
