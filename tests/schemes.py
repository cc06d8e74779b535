"""The test matrix every scheme runs through, read from the registry (as kvpress's tests/default_presses.py).

Every registered scheme, built-in or plug-in (`toy_scheme.py`, registered the way a user's `--plugin` is), with
each option set its entry declares (`Scheme.examples`; none: its defaults). A new scheme is in the matrix the moment
it is registered: the generic tests (properties, the drop-in contract, save/load, the window) parametrize over
`examples()`, and `check_contract` is the contract in one function, for a scheme a test registers itself.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import toy_scheme  # noqa: F401  (registers "toy", a plug-in, into the matrix)
from conftest import random_kv
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from gmlx_lab.registry import SCHEMES, get_scheme

WINDOW = 384  # a rolling window a windowed scheme can hold: the sink and two groups of 128


def examples(windowed: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """(scheme, options) for every registered scheme and each of its examples; `windowed`: only those that can be
    rolling windows of WINDOW tokens (`Scheme.check_window`)."""
    out = []
    for scheme in SCHEMES.values():
        for options in scheme.examples or ({},):
            if windowed:
                try:
                    scheme.check_window(WINDOW, scheme.resolve(**options), "matrix")
                except ValueError:
                    continue
            out.append((scheme.name, dict(options)))
    return out


def example_id(value: Any) -> str:
    """A readable pytest id: `kvarn-k_bits=8,v_bits=4` or the scheme alone."""
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "defaults"
    return str(value)


def make(scheme: str, options: dict[str, Any], layer: int | None = 0) -> Any:
    s = get_scheme(scheme)
    return s.make_cache(s.resolve(**options), layer=layer)


def _feed(cache: Any, k: mx.array, v: mx.array, chunks: list[int]) -> tuple[mx.array, mx.array]:
    start, out = 0, None
    for n in chunks:
        out = cache.update_and_fetch(k[:, :, start:start + n], v[:, :, start:start + n])
        start += n
    return out


def _same(a: tuple[mx.array, ...], b: tuple[mx.array, ...]) -> bool:
    return all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(a, b))


def check_contract(scheme: str, options: dict[str, Any], tokens: int = 420) -> None:
    """mlx-lm's cache contract for one (scheme, options): one chunk and many give the same stored form and fetch;
    offset, nbytes and regions agree; save_prompt_cache/load_prompt_cache round-trips bit for bit; a deep copy is
    independent; trimming the latest update gives back the cache that never saw it; bad input is a named error
    that leaves the cache as it was."""
    k, v = random_kv(tokens, seed=3)
    whole, pieces = make(scheme, options), make(scheme, options)
    a = _feed(whole, k, v, [tokens - 40, 39, 1])  # the same latest update: what is encoded by now is the same
    b = _feed(pieces, k, v, [tokens - 40, 17, 1, 1, 20, 1])
    assert whole.offset == pieces.offset == tokens
    assert a[0].shape == (1, 2, tokens, 128) and _same(a, b), f"{scheme}{options}: chunking changed the fetch"
    assert whole.nbytes == sum(whole.regions().values()) > 0

    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "cache.safetensors")
        save_prompt_cache(path, [whole])
        (loaded,) = load_prompt_cache(path)
    assert type(loaded) is type(whole) and loaded.offset == whole.offset
    step = (k[:, :, :1] * 0.5, v[:, :, :1] * 0.5)
    twin = copy.deepcopy(whole)
    assert _same(loaded.update_and_fetch(*step), whole.update_and_fetch(*step)), "save/load changed the cache"
    assert twin.offset == tokens, "a deep copy moved with its original"

    before = make(scheme, options)
    _feed(before, k, v, [tokens])
    if before.is_trimmable():
        grown = copy.deepcopy(before)
        grown.update_and_fetch(*step)
        assert grown.trim(1) == 1 and grown.offset == tokens
        assert _same(grown.update_and_fetch(*step), before.update_and_fetch(*step)), "trim did not give back the cache"

    held = before.offset
    for bad in ((k[:, :, :0], v[:, :, :0]), (k[:, :1], v), (k.astype(mx.int32), v)):
        try:
            before.update_and_fetch(*bad)
        except (ValueError, TypeError) as err:
            assert str(err), "an error without a message"
        else:
            raise AssertionError(f"{scheme}{options}: bad input {[x.shape for x in bad]} was accepted")
        assert before.offset == held, "a refused update changed the cache"
