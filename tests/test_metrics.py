"""Small metrics (gmlx_lab.measure.metrics): the Wilson interval of a passkey score."""

from __future__ import annotations

import math

import pytest

from gmlx_lab.measure.metrics import wilson_interval


@pytest.mark.parametrize("hits,trials", [(0, 24), (1, 24), (12, 24), (23, 24), (24, 24), (7, 30), (50, 100)])
def test_wilson_ends_are_where_the_score_test_just_rejects(hits: int, trials: int) -> None:
    """Each end x of the interval solves (p - x)^2 = z^2 x (1 - x) / n, the score test at its 95% boundary;
    an end at 0 or 1 belongs to 0 or n hits, where the interval reaches the edge."""
    z, p = 1.96, hits / trials
    low, high = wilson_interval(hits, trials)
    assert 0.0 <= low <= p <= high <= 1.0
    for end in (low, high):
        if end in (0.0, 1.0):
            assert p == end
        else:
            assert math.isclose((p - end) ** 2, z * z * end * (1 - end) / trials, rel_tol=1e-9)


def test_wilson_published_values() -> None:
    """0 of 24 keys: the upper end is z^2 / (n + z^2); 12 of 24 is symmetric about one half."""
    assert wilson_interval(0, 24) == (0.0, pytest.approx(1.96**2 / (24 + 1.96**2)))
    low, high = wilson_interval(12, 24)
    assert low == pytest.approx(1 - high) and low == pytest.approx(0.3143, abs=1e-4)


def test_wilson_narrows_with_more_trials_and_widens_with_z() -> None:
    small, large = wilson_interval(12, 24), wilson_interval(120, 240)
    assert large[1] - large[0] < small[1] - small[0]
    assert wilson_interval(12, 24, z=2.58)[0] < small[0]


@pytest.mark.parametrize("hits,trials", [(-1, 24), (25, 24), (0, 0), (1.0, 24), (True, 24)])
def test_wilson_refuses_what_is_not_a_count(hits, trials) -> None:
    with pytest.raises(ValueError, match="wilson_interval"):
        wilson_interval(hits, trials)
