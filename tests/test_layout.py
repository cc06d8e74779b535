"""The project's shape: what its configuration says about the tests."""

from __future__ import annotations

import pytest

from gmlx_lab.kernels import active_backend


def test_the_gpu_marker_says_what_happens_without_a_gpu(request: pytest.FixtureRequest) -> None:
    """`gpu` tests are not deselected on a CPU-only machine: conftest runs them on CPU threads, and the marker's
    text (pytest --markers) says so."""
    (text,) = [line for line in request.config.getini("markers") if line.startswith("gpu:")]
    assert "deselected" not in text and "CPU threads" in text and "CUDA and Metal" in text
    if active_backend() == "cpu":  # and they do: each gpu test of this session is parametrized by its source
        for item in request.session.items:
            if item.get_closest_marker("gpu"):
                assert item.callspec.params["kernel_source"] in ("cuda", "metal")
