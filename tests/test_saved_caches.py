"""Saved caches are checked when they load (gmlx_lab/cache/saved.py): the two failures the issue found, every
region's finiteness, the loader's switches. The random single corruptions of every scheme are a property in
test_properties.py."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from conftest import random_kv, tiny_llama
from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load
from mlx_lm.models.cache import save_prompt_cache

import gmlx_lab
from gmlx_lab.cache.buffers import KV
from gmlx_lab.cache.saved import trusted


@pytest.fixture(scope="module")
def saved_model_cache(tmp_path_factory: pytest.TempPathFactory):
    """A kvarn prompt cache of a small llama after 700 tokens (sink, records, live tokens and tail all held)."""
    model = tiny_llama()
    cache = gmlx_lab.make_cache(model, "kvarn", kv_tail_tokens=128, quiet=True)
    model(mx.random.randint(0, 300, (1, 700)), cache=cache)
    path = str(tmp_path_factory.mktemp("saved") / "prompt.safetensors")
    save_prompt_cache(path, cache)
    return model, cache, path


def rewrite(path: str, out: str, change) -> str:
    """Write `path`'s arrays with `change(arrays)` applied to `out`, metadata kept."""
    arrays, meta = mx.load(path, return_metadata=True)
    change(arrays)
    mx.save_safetensors(out, arrays, meta)
    return out


def test_a_cut_array_is_refused_naming_layer_array_and_shapes(saved_model_cache, tmp_path) -> None:
    """One array of layer 0 cut to a different width: refused at load, not at the first decode step in MLX."""
    _, _, path = saved_model_cache
    bad = rewrite(path, str(tmp_path / "cut.safetensors"), lambda a: a.update({"0.4": a["0.4"][..., :64]}))
    with pytest.raises(gmlx_lab.SavedCacheError, match=r"cache 0: layer 0 \(KvarnCache\): recent K holds "
                       r"\(1, 2, \d+, 64\) mlx.core.float16; expected \(1, 2, \d+, 128\)"):
        gmlx_lab.load_prompt_cache(bad)
    with pytest.raises(gmlx_lab.SavedCacheError, match="layer 0"):  # mlx-lm's own loader runs the same checks
        mlx_lm_load(bad)


def test_a_nan_in_the_sink_is_refused_unless_asked_and_check_finite_finds_it(saved_model_cache, tmp_path) -> None:
    _, _, path = saved_model_cache

    def nan_sink(arrays: dict) -> None:
        x = arrays["0.0"].flatten()
        x[5] = float("nan")
        arrays["0.0"] = x.reshape(arrays["0.0"].shape)

    bad = rewrite(path, str(tmp_path / "nan.safetensors"), nan_sink)
    with pytest.raises(gmlx_lab.SavedCacheError, match=r"layer 0 \(KvarnCache\): K in the sink holds inf or nan"):
        gmlx_lab.load_prompt_cache(bad)
    loaded = gmlx_lab.load_prompt_cache(bad, check_finite=False)  # to inspect it
    with pytest.raises(ValueError, match="layer 0: K in the sink holds inf or nan"):
        loaded[0].check_finite()
    loaded[1].check_finite()  # the other layers are whole


def test_a_sound_file_loads_bit_exactly_and_generates_as_the_original(saved_model_cache) -> None:
    model, cache, path = saved_model_cache
    loaded = gmlx_lab.load_prompt_cache(path)
    token = mx.array([[7]])
    a, b = model(token, cache=copy.deepcopy(cache)), model(token, cache=loaded)
    assert mx.array_equal(a, b)


@pytest.mark.parametrize("scheme,options", [("kvarn", {"kv_tail_tokens": 128}), ("kivi", {"sink_tokens": 4}),
                                            ("affine", {}), ("turboquant", {"sink_tokens": 4}), ("fp16", {})])
def test_check_finite_covers_every_region_held(scheme, options) -> None:
    """A nan put into any region a cache holds (after it arrived finite) is found by check_finite, which names
    the region: sink, blocks (codes and scales decoded), live tokens, tail, kvarn's copy of its newest block."""
    s = gmlx_lab.get_scheme(scheme)
    cache = s.make_cache(s.resolve(**options), layer=2)
    k, v = random_kv(700)
    cache.update_and_fetch(k, v)
    cache.update_and_fetch(k[:, :, :3], v[:, :, :3])
    cache.check_finite()
    regions = [(region, kind) for region, kind, _ in cache.stored_tokens()]
    assert len(regions) >= 2
    for region, kind in regions:
        broken = copy.deepcopy(cache)
        _poison(broken, region, kind)
        with pytest.raises(ValueError, match=f"layer 2: {kind} in the {region} holds inf or nan"):
            broken.check_finite()


def _poison(cache, region: str, kind: str) -> None:
    """Put a nan into the array behind one region's K or V (a float part of the blocks: their scales)."""
    i = "KV".index(kind)
    if region == "tokens":
        buf = (cache.keys, cache.values)[i]
        buf.data = _with_nan(buf.data)
    elif region == "sink":
        cache.sink = _swap(cache.sink, i, _with_nan(cache.sink[i]))
    elif region == "blocks":
        buf = next(b for b in cache.body_buffers[i] if b.dtype == mx.float16)  # the blocks' buffers hold them
        buf.data = _with_nan(buf.data)  # element 0, in the first block; `body` is made from the buffers when read
    elif region == "newest block's fp16 copy":
        cache.rollback = _swap(cache.rollback, i, _with_nan(cache.rollback[i]))
    else:
        buf = cache.recent[i]
        at = 0 if region == "live tokens" else cache.region_tokens()["live"]
        data = buf.data
        data[:, :, at] = float("nan")
        buf.data = data


def _swap(pair: KV, i: int, x) -> KV:
    """The K/V pair with item i (0: K, 1: V) replaced."""
    return KV(*(x if j == i else pair[j] for j in range(2)))


def _with_nan(x: mx.array) -> mx.array:
    flat = mx.array(x).flatten()
    flat[0] = float("nan")
    return flat.reshape(x.shape)


def test_another_layout_is_refused_with_the_version_named(saved_model_cache, tmp_path) -> None:
    _, _, path = saved_model_cache
    arrays, meta = mx.load(path, return_metadata=True)
    last = max((k for k in arrays if k.startswith("0.")), key=lambda k: int(k.split(".")[1]))
    arrays[last] = mx.array([ord(c) for c in "gmlx_lab.BlockCache/0"])
    mx.save_safetensors(str(tmp_path / "old.safetensors"), arrays, meta)
    with pytest.raises(gmlx_lab.SavedCacheError, match="saved in layout 'gmlx_lab.BlockCache/0'; this gmlx_lab "
                       "reads 'gmlx_lab.BlockCache/1'"):
        gmlx_lab.load_prompt_cache(str(tmp_path / "old.safetensors"))


def test_file_level_errors_name_the_file(tmp_path) -> None:
    missing = tmp_path / "nothing.safetensors"
    with pytest.raises(gmlx_lab.SavedCacheError, match="nothing.safetensors: cannot be read as a prompt-cache"):
        gmlx_lab.load_prompt_cache(missing)
    mx.save_safetensors(str(tmp_path / "plain.safetensors"), {"w": mx.zeros((2,))})
    with pytest.raises(gmlx_lab.SavedCacheError, match="metadata is not a prompt cache's"):
        gmlx_lab.load_prompt_cache(tmp_path / "plain.safetensors")


def test_a_deep_copy_skips_the_load_checks() -> None:
    """Copies rebuild from a live cache's own state, already checked: `trusted` makes from_state take it as it is."""
    s = gmlx_lab.get_scheme("kvarn")
    cache = s.make_cache(s.resolve(), layer=0)
    k, v = random_kv(300)
    cache.update_and_fetch(k, v)
    state = list(cache.state)
    state[-1] = "not a layout"
    with pytest.raises(gmlx_lab.SavedCacheError):
        type(cache).from_state(state)
    with trusted():
        type(cache).from_state(list(cache.state))
