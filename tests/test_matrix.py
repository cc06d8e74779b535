"""Every registered scheme through one matrix (tests/schemes.py), and a scheme added the way CONTRIBUTING.md says
joins it with nothing else edited."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import random_kv
from schemes import check_contract, example_id, examples, make

from gmlx_lab.cache import attention, block, scheme_modules
from gmlx_lab.registry import SCHEMES

ROOT = Path(__file__).resolve().parents[1]


def test_the_matrix_holds_every_registered_scheme() -> None:
    names = {name for name, _ in examples()}
    assert names == set(SCHEMES) and "toy" in names  # built-ins and the plug-in alike
    assert {name for name, _ in examples(windowed=True)} >= {"fp16", "affine", "kvarn"}


@pytest.mark.parametrize("scheme, options", examples(), ids=example_id)
def test_every_registered_scheme_keeps_the_cache_contract(scheme: str, options: dict) -> None:
    check_contract(scheme, options)


def quantized_examples() -> list[tuple[str, dict]]:
    """The examples whose caches store blocks (every scheme but fp16, which hands mlx's SDPA its own K/V)."""
    return [(name, options) for name, options in examples() if hasattr(make(name, options), "key_slices")]


@pytest.mark.parametrize("scheme, options", quantized_examples(), ids=example_id)
def test_a_cache_longer_than_a_slice_attends_a_slice_at_a_time_as_over_its_fetch(
        scheme: str, options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """With scratch for about 128 keys, a prompt chunk (causal or an array mask) over 700 tokens attends slice by slice
    (sink, body, recent), and it and a decode step give what SDPA over the fetched K/V gives."""
    cache = make(scheme, options)
    calls = []
    sliced = block.sliced_attention
    monkeypatch.setattr(block, "sliced_attention", lambda *a: calls.append(len(a[-1])) or sliced(*a))
    k, v = random_kv(700, seed=5)
    cache.update_and_fetch(k[:, :, :694], v[:, :, :694])
    keys, values = cache.update_and_fetch(k[:, :, 694:], v[:, :, 694:])
    mx.random.seed(6)
    queries = mx.random.normal((1, 4, 6, 128))
    monkeypatch.setattr(attention, "SCRATCH_BYTES", 4 * (6 * 4 * 6 + 4 * 128) * 128)
    assert len(cache.key_slices(mx.float32, 128)) >= 4  # the body in several slices, beside the fp16 regions
    causal = mx.arange(694, 700)[:, None] >= mx.arange(700)[None]
    for q, mask in ((queries, "causal"), (queries, causal), (queries[:, :, -1:], None)):
        ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.09, mask=mask)
        out = cache.attend(q, keys, values, scale=0.09, mask=mask)
        assert out.shape == ref.shape and float(mx.abs(out - ref).max()) < 1e-4, f"{scheme}{options}, mask {mask}"
    # both prompt chunks in slices; the decode step too, unless the scheme reads its codes (affine's quantized_matmul)
    assert len(calls) >= 2 and min(calls) >= 4, f"{scheme}{options}: attended in slices {calls}"


# A scheme written as CONTRIBUTING.md's "Pure MLX" recipe says: one module, its options on the class, a registry
# entry; sign-magnitude codes of each token's row in groups of 32, one fp16 scale a group.
NEW_SCHEME = '''
"""signmag: each token's row in groups of 32 channels, sign and magnitude codes, one fp16 scale a group."""

from __future__ import annotations

import mlx.core as mx

from gmlx_lab.cache.block import BlockCache, BlockScheme
from gmlx_lab.registry import Option, register_scheme


class SignMagCache(BlockCache):
    """Rows in groups of 32 channels: round(x / scale) in [-(2^(bits-1) - 1), 2^(bits-1) - 1], fp16 scales."""

    scheme = "signmag"
    block_tokens = 8
    OPTIONS = (Option("bits", 4, "code width", (4, 8)), Option("kv_tail_tokens", 8, "newest tokens kept fp16"))

    def encode(self, x, kind):
        groups = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
        top = 2 ** (self.bits - 1) - 1
        scale = mx.maximum(mx.max(mx.abs(groups), axis=-1, keepdims=True) / top, 1e-4).astype(mx.float16)
        return mx.round(groups / scale.astype(mx.float32)).astype(mx.int8), scale

    def decode(self, parts, kind):
        codes, scale = parts
        x = codes.astype(mx.float32) * scale.astype(mx.float32)
        return x.reshape(*x.shape[:-2], -1)


SCHEME = register_scheme(BlockScheme("signmag", "sign-magnitude codes in groups of 32 (a test's own scheme)",
                                     cache_class=SignMagCache, examples=({}, {"bits": 8, "kv_tail_tokens": 0})))
'''


def test_a_scheme_added_as_contributing_says_joins_the_matrix(tmp_path: Path) -> None:
    """One module dropped into the schemes' folder is found there (`scheme_modules`), registers on import, and
    runs through the whole matrix: no list, test or registry to edit."""
    folder = tmp_path / "cache"
    folder.mkdir()
    for shared in ("base", "block", "window"):  # the shared tier beside it is not a scheme
        (folder / f"{shared}.py").write_text("")
    (folder / "signmag.py").write_text(textwrap.dedent(NEW_SCHEME))
    assert scheme_modules(folder) == ["signmag"]
    spec = importlib.util.spec_from_file_location("signmag", folder / "signmag.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["signmag"] = module
    try:
        spec.loader.exec_module(module)
        assert "signmag" in SCHEMES
        added = [(name, options) for name, options in examples() if name == "signmag"]
        assert added == [("signmag", {}), ("signmag", {"bits": 8, "kv_tail_tokens": 0})]
        for name, options in added:
            check_contract(name, options)
    finally:
        SCHEMES.pop("signmag", None)
        sys.modules.pop("signmag", None)


def test_contributing_names_the_steps_the_matrix_checks() -> None:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    for step in ("OPTIONS", "examples", "tests/schemes.py", "gmlx_lab/cache/NAME.py"):
        assert step in text, f"CONTRIBUTING.md's 'Adding a scheme' should name {step}"
