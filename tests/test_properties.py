"""Properties of every cache scheme, checked with hypothesis on inputs it draws (widths, tails, lengths, chunkings).

Every registered scheme, built-in or plug-in (tests/schemes.py), drawn from the examples its entry declares with
its widths, group sizes, formats and tails drawn among the values it accepts (`specs`), holds on random K/V and
through a small mlx-lm llama:
  - chunking: the stored form does not depend on how the tokens arrived, and through a model one chunk,
    random chunks and one token at a time give the same logits within the tolerances stated at each test;
  - causality: changing token t never changes the logits before t;
  - trim then continue equals never having seen the trimmed tokens (kvarn: at most the latest update's);
  - save/load (mlx-lm's save_prompt_cache/load_prompt_cache) at any offset is bit-exact and continues
    identically; a deep copy is independent of its original and continues like it;
  - batch rows equal single rows; every bad input is a named error that leaves the cache as it was.
Then mlx-lm's own prompt-cache test patterns (tests/test_prompt_cache.py in ml-explore/mlx-lm: save/load
with metadata, generating in parts, trim_prompt_cache, copying, masks), rewritten for every scheme.

Sizes: the "ci" profile (the default) runs a bounded number of examples per property, derandomized so a
CI run is repeatable, and does not shrink failures; HYPOTHESIS_PROFILE=nightly runs 10x as many with fresh
random seeds and shrinks what fails to a small example.
"""

import copy
import os
import re
import tempfile
from typing import Any, NamedTuple

import mlx.core as mx
import pytest
from conftest import random_kv, tiny_llama
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from mlx.utils import tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.models.base import create_attention_mask, create_causal_mask
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache, trim_prompt_cache
from schemes import examples as registered  # the matrix (it registers the toy plug-in too)

import gmlx_lab
from gmlx_lab.cache import BlockCache, GmlxCache
from gmlx_lab.cache.block import block_regions
from gmlx_lab.cache.kvarn.records import KVARN_BITS, SINK_TOKENS, TILE, region_tokens
from gmlx_lab.registry import SCHEMES, get_scheme

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
SCALE = {"ci": 1, "nightly": 10}.get(PROFILE)
if SCALE is None:
    raise ValueError(f"HYPOTHESIS_PROFILE={PROFILE!r}; accepted: ci, nightly")
_common = {"deadline": None, "print_blob": True,
           "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
# ci: no shrinking (a model-level failure can take minutes to shrink); the failure is printed with a
# @reproduce_failure blob, and nightly shrinks what it finds
settings.register_profile("ci", max_examples=25, derandomize=True,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate], **_common)
settings.register_profile("nightly", max_examples=250, **_common)
settings.load_profile(PROFILE)


def examples(ci: int) -> settings:
    """A property's example count: `ci` in the ci profile, 10x in nightly."""
    return settings(max_examples=ci * SCALE)


# -- schemes and inputs -----------------------------------------------------------------------------------

TAILS = (0, 1, 128, 200)


class Spec(NamedTuple):
    """A scheme and its options, as make_cache takes them."""

    scheme: str
    options: dict

    def make(self, layer: int | None = None) -> GmlxCache:
        scheme = get_scheme(self.scheme)
        return scheme.make_cache(scheme.resolve(**self.options), layer=layer)

    @property
    def tail(self) -> int:
        return self.options.get("kv_tail_tokens", 0)

    @property
    def blocks(self) -> bool:
        """A scheme on the block base that encodes whole blocks once a later update came (turboquant, float, kivi;
        affine encodes its one-token blocks as they arrive)."""
        cache = self.make()
        return isinstance(cache, BlockCache) and not cache.encode_on_arrival

    @property
    def low(self) -> int:
        """Tokens after which a first record or block can be encoded (2 for schemes that quantize on arrival)."""
        if self.scheme == "kvarn":
            return SINK_TOKENS + TILE + self.tail + 1
        if self.blocks:
            c = self.make()
            return c.sink_tokens + c.block_tokens + c.kv_tail_tokens + 1
        return 2

    def __repr__(self) -> str:
        return f"{self.scheme}{self.options}"


def specs(quantized_kv_start: bool = True, norm_iters: tuple[int, ...] = (2, 16)) -> st.SearchStrategy[Spec]:
    """Every registered scheme (tests/schemes.py: built-ins and the toy plug-in alike), each drawn from its entry's
    examples, then each option with accepted values (widths, K and V apart, group sizes, formats, rotation, QJL)
    drawn among them, the fp16 tail among TAILS and the sink among 0 and 4; `quantized_kv_start` and `norm_iters`
    as the test asks. A drawn set the scheme refuses (a float width with no format) is skipped. kvarn is drawn
    twice as often: it has the most geometry."""
    names = [name for name in SCHEMES for _ in range(2 if name == "kvarn" else 1)]
    return st.sampled_from(names).flatmap(lambda name: _scheme_spec(name, quantized_kv_start, norm_iters))


@st.composite
def _scheme_spec(draw: Any, name: str, quantized_kv_start: bool, norm_iters: tuple[int, ...]) -> Spec:
    scheme = get_scheme(name)
    options = dict(draw(st.sampled_from(scheme.examples or ({},))))
    drawn = {"kv_tail_tokens": TAILS, "sink_tokens": (0, 4), "norm_iters": norm_iters,
             "quantized_kv_start": (0, 0, 7, 200) if quantized_kv_start else (0,)}
    for opt in scheme.options:
        values = opt.choices or drawn.get(opt.name)
        if values and (opt.name in ("norm_iters", "quantized_kv_start") or draw(st.booleans())):
            options[opt.name] = draw(st.sampled_from(values))
    try:
        scheme.resolve(**options)
    except ValueError:
        assume(False)
    return Spec(name, options)


def lengths(low: int, high: int, tail: int = 0) -> st.SearchStrategy[int]:
    """Token counts in [low, high], half of them within a few tokens of an edge: where kvarn seals a group at
    this tail (128 sink tokens + whole groups of 128 + the tail) or where a buffer fills (steps of 256)."""
    edges = {SINK_TOKENS + TILE * g + tail + d for g in (1, 2, 3) for d in range(-3, 4)}
    edges |= {256 * g + d for g in (1, 2) for d in range(-2, 3)}
    near = sorted(n for n in edges if low <= n <= high)
    return st.one_of(st.integers(low, high), st.sampled_from(near)) if near else st.integers(low, high)


def cases(low: int, high: int, **kwargs: Any) -> st.SearchStrategy[tuple[Spec, int]]:
    """A scheme (see `specs`) and a token count (see `lengths`) near its edges."""
    return specs(**kwargs).flatmap(lambda spec: st.tuples(st.just(spec), lengths(low, high, spec.tail)))


@st.composite
def chunkings(draw: Any, total: int, max_chunks: int = 8) -> list[int]:
    """Sizes of the updates that deliver `total` tokens: one chunk, random cuts, a prefix then 1-token steps, or
    a prefix then one short update (a draft, as speculative decoding sends)."""
    kind = draw(st.sampled_from(["one", "cuts", "cuts", "steps", "draft"]))
    if kind == "one" or total == 1:
        return [total]
    if kind == "draft":
        last = draw(st.integers(1, min(total - 1, 130)))
        return [total - last, last]
    if kind == "steps":
        prefix = draw(st.integers(1, total - 1))
        return [prefix] + [1] * min(total - prefix, 40) + ([total - prefix - 40] if total - prefix > 40 else [])
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), min_size=1, max_size=max_chunks - 1)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def feed(cache: Any, k: mx.array, v: mx.array, chunks: list[int], start: int = 0) -> tuple[mx.array, mx.array]:
    """Feed K/V tokens [start, start + sum(chunks)) through update_and_fetch, chunk by chunk; the last K/V fetched."""
    out = None
    for n in chunks:
        out = cache.update_and_fetch(k[:, :, start:start + n], v[:, :, start:start + n])
        start += n
    return out


def leaves(tree: Any) -> list:
    if isinstance(tree, (tuple, list)):
        return [x for t in tree for x in leaves(t)]
    return [tree]


def assert_same_state(a: Any, b: Any) -> None:
    """Bit-exact equality of two caches' states: every array's dtype, shape and values, every scalar."""
    assert type(a) is type(b)
    la, lb = leaves(a.state), leaves(b.state)
    assert len(la) == len(lb)
    for i, (x, y) in enumerate(zip(la, lb)):
        if isinstance(x, mx.array):
            assert isinstance(y, mx.array) and x.dtype == y.dtype and x.shape == y.shape, i
            assert mx.array_equal(x, y), i
        else:
            assert x == y, (i, x, y)


def same_arrays(a: tuple, b: tuple) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y) for x, y in zip(a, b))


def kv(tokens: int, seed: int, batch: int = 1, dim: int = 128) -> tuple[mx.array, mx.array]:
    """Random K/V (batch, 2 heads, tokens, dim) with outlier channels in K; rows of a batch differ."""
    rows = [random_kv(tokens, dim=dim, seed=seed + 1000 * b) for b in range(batch)]
    return tuple(mx.concatenate([r[i] for r in rows]) if batch > 1 else rows[0][i] for i in range(2))


# -- the stored form ------------------------------------------------------------------------------------------

@examples(30)
@given(case=cases(1, 600), data=st.data())
def test_stored_form_does_not_depend_on_chunking(case, data):
    """fp16 and affine store each token on its own; kvarn's records, once `seal()` has sealed what is due,
    are the same tiles of the same fp16 tokens: the states are bit-identical, however the tokens arrived."""
    spec, total = case
    k, v = kv(total, seed=total)
    chunks = data.draw(chunkings(total), "chunks")
    whole, split = spec.make(), spec.make()
    feed(whole, k, v, [total])
    feed(split, k, v, chunks)
    if spec.scheme == "kvarn":
        assert split.region_tokens() == region_tokens(total, spec.tail, newest=chunks[-1])
    if spec.scheme == "kvarn" or spec.blocks:
        whole.seal()
        split.seal()
    assert_same_state(whole, split)


# -- trim ---------------------------------------------------------------------------------------------------------

@examples(30)
@given(case=cases(2, 600), data=st.data())
def test_trim_then_continue_equals_never_seeing_the_tokens(case, data):
    """Trim r tokens, continue with X: the same state and the same fetched K/V as a cache that got the same
    updates without those r tokens. kvarn may trim at most the latest update's tokens; affine may not trim back
    below quantized_kv_start once it has quantized (the codes cannot become fp16 again)."""
    spec, total = case
    chunks = data.draw(chunkings(total - 1), "chunks")
    k, v = kv(total + 40, seed=total)
    latest = chunks[-1]
    limit = latest if spec.scheme == "kvarn" or spec.blocks else total - 1
    start = spec.options.get("quantized_kv_start", 0)
    if start and total - 1 >= start:  # affine has quantized: keep at least quantized_kv_start tokens
        limit = min(limit, total - 1 - start)
    r = data.draw(st.one_of(st.just(limit), st.integers(0, limit)), "r")
    more = data.draw(st.one_of(st.just(1), st.integers(1, 40)), "more")
    trimmed = spec.make()
    feed(trimmed, k, v, chunks)
    assert trimmed.trim(r) == r and trimmed.offset == total - 1 - r
    if spec.blocks:  # blocks encoded when the trimmed update arrived stay encoded (the base cannot restore them):
        # compare only where a cache that never saw the r tokens holds those blocks encoded too after X
        c = trimmed
        never_body = block_regions(total - 1 - r + more, c.block_tokens, c.sink_tokens, c.kv_tail_tokens, more)
        assume(trimmed.region_tokens()["body"] <= never_body["body"])
    # X, the same new tokens for both, follows the kept tokens
    x_k, x_v = k[:, :, total:total + more], v[:, :, total:total + more]
    got = trimmed.update_and_fetch(x_k, x_v)
    never = spec.make()
    kept = chunks[:-1] + ([latest - r] if latest > r else [])
    if spec.scheme != "kvarn" and r > latest:  # fp16/affine trimmed into earlier updates: any split of the rest
        kept = [total - 1 - r] if total - 1 - r else []
    feed(never, k, v, kept)
    expect = never.update_and_fetch(x_k, x_v)
    assert same_arrays(got, expect)
    assert_same_state(trimmed, never)


@examples(30)
@given(bits=st.tuples(st.sampled_from(KVARN_BITS), st.sampled_from(KVARN_BITS)), tail=st.sampled_from(TAILS),
       data=st.data())
def test_trimming_a_kvarn_draft_gives_back_the_cache_that_never_saw_it(bits, tail, data):
    """Speculative decoding's shape, near the edges where a group seals: a prompt, a draft of up to 130 tokens,
    a rejection that trims r of them, then m <= r accepted tokens: the cache that never saw the r tokens."""
    spec = Spec("kvarn", {"k_bits": bits[0], "v_bits": bits[1], "kv_tail_tokens": tail, "norm_iters": 2})
    past_edge = data.draw(st.one_of(st.integers(0, 3), st.integers(-3, 130)), "tokens past a seal edge")
    total = SINK_TOKENS + TILE * data.draw(st.integers(1, 3), "groups") + tail + past_edge
    draft = data.draw(st.integers(1, min(total - 1, 130)), "draft")
    r = data.draw(st.one_of(st.just(draft), st.integers(1, draft)), "r")
    m = data.draw(st.one_of(st.just(1), st.integers(1, r)), "m")
    k, v = kv(total + m, seed=total)
    drafted, never = spec.make(), spec.make()
    feed(drafted, k, v, [total - draft, draft])
    assert drafted.trim(r) == r
    got = drafted.update_and_fetch(k[:, :, total:], v[:, :, total:])
    feed(never, k, v, [total - draft] + ([draft - r] if draft > r else []))
    assert same_arrays(got, never.update_and_fetch(k[:, :, total:], v[:, :, total:]))
    assert_same_state(drafted, never)


@examples(25)
@given(case=cases(1, 600, quantized_kv_start=False), data=st.data())
def test_trim_beyond_what_can_be_rolled_back_is_refused_and_changes_nothing(case, data):
    """kvarn refuses to trim into sealed records (ValueError naming the layer); every cache refuses negative and
    non-int counts; a refused trim leaves the state as it was. A count past the start trims to the start, as
    mlx-lm's KVCache does (fp16 and affine can always roll back)."""
    spec, total = case
    k, v = kv(total, seed=total)
    cache = spec.make(layer=4)
    feed(cache, k, v, data.draw(chunkings(total), "chunks"))
    twin = copy.deepcopy(cache)
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ValueError, match="layer 4: trim"):
            cache.trim(bad)
    if spec.scheme == "kvarn" or spec.blocks:
        cache.seal()
        twin.seal()
        regions = cache.region_tokens()
        rollback = regions["live"] + regions["tail"] + (regions["sink"] if regions["body"] == 0 else 0)
        assert cache.trim(0) == 0
        if rollback < total:
            with pytest.raises(ValueError, match=f"layer 4: cannot trim {rollback + 1} tokens, only {rollback}"):
                cache.trim(rollback + 1)
    else:
        assert cache.trim(total + 5) == total and cache.offset == 0 and cache.empty()
        return
    assert_same_state(cache, twin)


# -- save and load ------------------------------------------------------------------------------------------------

@examples(30)
@given(case=cases(0, 600), more=st.integers(1, 130), data=st.data())
def test_save_load_at_any_offset_is_bit_exact_and_continues_identically(case, more, data):
    """Through mlx-lm's save_prompt_cache/load_prompt_cache, with metadata, at any offset (0 too): the same
    arrays (dtype, shape, bits) and scalars, and the same K/V and state after more updates."""
    spec, total = case
    k, v = kv(total + more, seed=total + 1)
    cache = spec.make(layer=0)
    if total:
        feed(cache, k, v, data.draw(chunkings(total), "chunks"))
    metadata = {"scheme": repr(spec), "offset": str(total)}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "cache.safetensors")
        save_prompt_cache(path, [cache], metadata)
        (loaded,), meta = load_prompt_cache(path, return_metadata=True)
    assert meta == metadata
    assert_same_state(cache, loaded)
    assert loaded.offset == cache.offset == total and loaded.nbytes <= cache.nbytes  # no growth reserve on load
    rest = data.draw(chunkings(more), "rest")
    assert same_arrays(feed(cache, k, v, rest, start=total), feed(loaded, k, v, rest, start=total))
    assert_same_state(cache, loaded)


# -- saved caches are checked when they load ----------------------------------------------------------------------

CORRUPTIONS = ("shape", "dtype", "scalar", "nan", "missing", "truncate", "layout")
# the fixed scalars of each layout (item indices in `state`): offset, newest, layer, geometry, K/V shape, window,
# dropped, sliding window; each is refused at -1
FIXED_SCALARS = {"FP16Cache": range(2, 12), "default": range(6, 20)}
RETYPE = {mx.float16: mx.float32, mx.float32: mx.float16, mx.bfloat16: mx.float16, mx.uint32: mx.int32,
          mx.uint8: mx.int8, mx.int8: mx.uint8, mx.int32: mx.uint32}


def saved_specs() -> st.SearchStrategy[Spec]:
    """Every registered scheme, the toy plug-in included (see `specs`)."""
    return specs()


def corrupt(path: str, kind: str, data: Any) -> str:
    """Change the saved file at `path` in one way (`kind`, details drawn from `data`); returns what was done."""
    if kind == "truncate":
        raw = open(path, "rb").read()
        cut = data.draw(st.integers(0, len(raw) - 1), "cut")
        open(path, "wb").write(raw[:cut])
        return f"truncated to {cut} of {len(raw)} bytes"
    arrays, meta = mx.load(path, return_metadata=True)
    scalar_kind = {pos: k for pos, k in tree_unflatten(list(meta.items()))[2][1:]}
    held = sorted(k for k in arrays if k not in scalar_kind and arrays[k].size)
    layout = next(pos for pos, k in scalar_kind.items() if k == "string" and pos.startswith("0.")
                  and "".join(chr(i) for i in arrays[pos].tolist()).startswith("gmlx_lab."))
    if kind == "layout":
        arrays[layout] = mx.array([ord(c) for c in "gmlx_lab.BlockCache/0"])
        what = "layout tag set to another version"
    elif kind == "missing":
        key = data.draw(st.sampled_from(sorted(arrays)), "key")
        del arrays[key]
        what = f"item {key} deleted"
    elif kind == "scalar":
        items = FIXED_SCALARS["FP16Cache" if "FP16Cache" in meta.values() else "default"]
        keys = [f"0.{i}" for i in items if scalar_kind.get(f"0.{i}") == "scalar"]
        key = data.draw(st.sampled_from(keys), "key")
        arrays[key] = mx.array(-1)
        what = f"scalar {key} set to -1"
    else:
        pool = [k for k in held if kind != "nan" or arrays[k].dtype in (mx.float16, mx.float32, mx.bfloat16)]
        assume(pool)
        key = data.draw(st.sampled_from(pool), "key")
        x = arrays[key]
        if kind == "dtype":
            arrays[key] = x.astype(RETYPE[x.dtype])
            what = f"{key} retyped {x.dtype} -> {arrays[key].dtype}"
        elif kind == "shape":
            axis = data.draw(st.integers(0, x.ndim - 1), "axis")
            arrays[key] = mx.take(x, mx.arange(x.shape[axis] - 1), axis=axis) if x.shape[axis] > 1 else \
                mx.concatenate([x, x], axis=axis)
            what = f"{key} axis {axis}: {x.shape} -> {arrays[key].shape}"
        else:
            flat = x.flatten()
            at = data.draw(st.integers(0, flat.size - 1), "at")
            flat[at] = float("nan")
            arrays[key] = flat.reshape(x.shape)
            what = f"{key} element {at} set to nan"
    mx.save_safetensors(path, arrays, meta)
    return what


@examples(60)
@given(spec=saved_specs(), data=st.data(), kind=st.sampled_from(CORRUPTIONS))
def test_every_single_corruption_of_a_saved_cache_is_refused_when_it_loads(spec, data, kind):
    """A saved cache with one thing wrong (an array's shape or dtype, a scalar out of range, a nan in any region,
    an item missing, the file cut short, another layout) is refused by gmlx_lab's loader with one SavedCacheError
    naming the file and what is wrong, never loaded to fail later; the unchanged file loads bit-exactly."""
    total = data.draw(lengths(1, 560, spec.tail), "total")
    k, v = kv(total, seed=total + 5)
    cache = spec.make(layer=0)
    feed(cache, k, v, data.draw(chunkings(total), "chunks"))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "cache.safetensors")
        save_prompt_cache(path, [cache])
        assert_same_state(cache, gmlx_lab.load_prompt_cache(path)[0])
        what = corrupt(path, kind, data)
        with pytest.raises(gmlx_lab.SavedCacheError) as refused:
            gmlx_lab.load_prompt_cache(path)
    message = str(refused.value)
    assert message.startswith(path), (what, message)
    if kind in ("shape", "dtype", "scalar", "nan", "layout"):
        assert type(cache).__name__ in message, (what, message)
    if kind == "nan":
        assert "inf or nan" in message, (what, message)


# -- deep copies --------------------------------------------------------------------------------------------------

@examples(30)
@given(spec=specs(), data=st.data())
def test_deep_copy_is_independent_and_continues_like_its_original(spec, data):
    """The original trims r tokens of its latest update and writes m <= r other tokens in their place (in its
    buffer, where the copy's tokens are); the copy continues with the true tokens. The copy ends in the state of
    a cache that was never copied, and the original in the state of one that never saw the copy's tokens.
    Buffers that are exactly full (256 or 512 tokens; kvarn's recent tokens right after a seal) are the case
    where a copy once shared the original's buffer, so a quarter of the examples have 256 or 512 tokens."""
    total = data.draw(st.one_of(st.sampled_from([256, 512]), lengths(1, 520, spec.tail), lengths(1, 520, spec.tail),
                                lengths(1, 520, spec.tail)), "total")
    chunks = data.draw(chunkings(total), "chunks")
    k, v = kv(total + 20, seed=total + 2)
    cache = spec.make()
    feed(cache, k, v, chunks)
    twin = copy.deepcopy(cache)
    r = data.draw(st.one_of(st.integers(1, chunks[-1]), st.integers(0, chunks[-1])), "r")
    if spec.scheme.startswith("affine") and cache.quantized and total - r < spec.options["quantized_kv_start"]:
        r = 0  # see test_trim_then_continue_equals_never_seeing_the_tokens
    m = data.draw(st.integers(1, max(1, r)), "m")
    other = (k[:, :, total - r:total - r + m] * 2 + 1, v[:, :, total - r:total - r + m] - 1)
    cache.trim(r)
    cache.update_and_fetch(*other)
    got = twin.update_and_fetch(k[:, :, total:], v[:, :, total:])
    plain = spec.make()
    assert same_arrays(got, feed(plain, k, v, [*chunks, 20]))
    assert_same_state(twin, plain)
    original = spec.make()
    feed(original, k, v, chunks)
    original.trim(r)
    original.update_and_fetch(*other)
    assert_same_state(cache, original)


# -- batches ------------------------------------------------------------------------------------------------------

@examples(20)
@given(case=cases(1, 520), data=st.data())
def test_batch_rows_equal_single_rows_in_the_cache(case, data):
    """Each (batch row, head) is stored and fetched on its own: bit-identical to feeding that row alone."""
    spec, total = case
    chunks = data.draw(chunkings(total), "chunks")
    k, v = kv(total, seed=total + 3, batch=2)
    both = spec.make()
    fetched = feed(both, k, v, chunks)
    for row in range(2):
        alone = spec.make()
        single = feed(alone, k[row:row + 1], v[row:row + 1], chunks)
        assert same_arrays(tuple(x[row:row + 1] for x in fetched), single)


# -- bad input ----------------------------------------------------------------------------------------------------

BAD_UPDATES = ["ndim 3", "ndim 5", "int32", "uint8", "0 tokens", "k/v tokens differ", "batch", "heads", "k dim",
               "v dim", "not an array"]


def bad_update(kind: str, k: mx.array, v: mx.array) -> tuple[Any, Any, type, str]:
    """K/V that break one rule, the error type and the words its message must hold."""
    shape_changed = "K/V shape changed between updates"
    if kind == "ndim 3":
        return k[0], v[0], ValueError, r"must be \(batch, kv_heads, tokens, head_dim\)"
    if kind == "ndim 5":
        return k[None], v[None], ValueError, r"must be \(batch, kv_heads, tokens, head_dim\)"
    if kind in ("int32", "uint8"):
        return k.astype(getattr(mx, kind)), v, TypeError, f"keys have dtype mlx.core.{kind}; accepted: float16"
    if kind == "0 tokens":
        return k[:, :, :0], v[:, :, :0], ValueError, "an update with 0 tokens"
    if kind == "k/v tokens differ":
        return k, v[:, :, :1], ValueError, "matching first three axes"
    if kind == "batch":
        return mx.concatenate([k, k]), mx.concatenate([v, v]), ValueError, f"{shape_changed} \\(batch 1 -> 2\\)"
    if kind == "heads":
        return k[:, :1], v[:, :1], ValueError, f"{shape_changed} \\(kv heads 2 -> 1\\)"
    if kind == "k dim":
        return mx.concatenate([k, k], axis=-1), v, ValueError, f"{shape_changed} \\(key head_dim 128 -> 256\\)"
    if kind == "v dim":
        return k, mx.concatenate([v, v], axis=-1), ValueError, f"{shape_changed} \\(value head_dim 128 -> 256\\)"
    return k.tolist(), v, TypeError, "keys and values must be mx.array"


@examples(40)
@given(case=cases(1, 400), kind=st.sampled_from(BAD_UPDATES), data=st.data())
def test_every_bad_update_is_a_named_error_that_changes_nothing(case, kind, data):
    spec, total = case
    k, v = kv(total + 3, seed=total)
    cache = spec.make(layer=6)
    feed(cache, k, v, data.draw(chunkings(total), "chunks"))
    twin = copy.deepcopy(cache)
    bad_k, bad_v, error, words = bad_update(kind, k[:, :, total:], v[:, :, total:])
    with pytest.raises(error, match=f"layer 6: .*{words}"):
        cache.update_and_fetch(bad_k, bad_v)
    assert_same_state(cache, twin)
    assert same_arrays(cache.update_and_fetch(k[:, :, total:], v[:, :, total:]),
                       twin.update_and_fetch(k[:, :, total:], v[:, :, total:]))


def bad_values(option: Any) -> st.SearchStrategy:
    """Values the option does not accept: not ints, and ints outside its choices or below its minimum."""
    wrong_type = st.sampled_from([True, False, None, "4", 4.0, [4], b"4"])
    if option.choices is not None:
        wrong_int = st.integers(-10, 300).filter(lambda x: x not in option.choices)
    else:
        wrong_int = st.integers(-1000, option.minimum - 1)
    return st.one_of(wrong_type, wrong_int)


CONSTRUCTOR_OPTIONS = [(s, o) for s in ("affine", "affine_rot") for o in ("bits", "group_size", "quantized_kv_start")]
CONSTRUCTOR_OPTIONS += [("kvarn", o) for o in ("k_bits", "v_bits", "kv_tail_tokens", "norm_iters")]
CONSTRUCTOR_OPTIONS += [(s, o) for s in ("turboquant", "float", "kivi") for o in get_scheme(s).defaults()
                        if o not in ("kv_tail_tokens", "sink_tokens")]  # geometry: BlockCache's own check


@examples(40)
@given(which=st.sampled_from(CONSTRUCTOR_OPTIONS), data=st.data())
def test_every_bad_constructor_option_is_a_named_error(which, data):
    """The cache classes check options with the registry (one place), naming the option and what is accepted."""
    scheme, name = which
    option = get_scheme(scheme).option(name)
    value = data.draw(bad_values(option), "value")
    cls = get_scheme(scheme).cache_class
    with pytest.raises(ValueError, match=f"layer 2: {scheme}: .*{re.escape(f'{name}={value!r}')}") as exc:
        cls(**{name: value}, layer=2)
    assert option.accepted() in str(exc.value)
    if value is not None:  # resolve() reads None as "the default"
        with pytest.raises(ValueError, match=re.escape(option.accepted())):
            get_scheme(scheme).resolve(**{name: value})


# -- through a model ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    return tiny_llama(layers=2)


def model_logits(model: Any, tokens: mx.array, spec: Spec, chunks: list[int]) -> mx.array:
    cache = gmlx_lab.make_cache(model, spec.scheme, quiet=True, **spec.options)
    out, start = [], 0
    for n in chunks:
        out.append(model(tokens[:, start:start + n], cache=cache))
        start += n
    result = mx.concatenate(out, axis=1) if len(out) > 1 else out[0]
    mx.eval(result)
    return result


def records_seen(chunks: list[int], spec: Spec) -> list[int]:
    """For each position, the tokens its query sees as kvarn records (or encoded blocks): those sealed before its
    update."""
    seen, start, c = [], 0, spec.make()
    for n in chunks:
        if spec.scheme == "kvarn":
            seen += [region_tokens(start + n, spec.tail, newest=n)["body"]] * n
        else:
            seen += [block_regions(start + n, c.block_tokens, c.sink_tokens, c.kv_tail_tokens, newest=n)["body"]] * n
        start += n
    return seen


FLOAT_TOL = 1e-3  # logits (|x| up to ~8) of a float32 model whose K/V are rounded to fp16: measured <= 1e-4


def max_diff(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a - b).max()) if a.size else 0.0


@examples(8)
@given(spec=specs(quantized_kv_start=False, norm_iters=(16,)), data=st.data())
def test_chunking_invariance_through_a_model(small, spec, data):
    """One chunk (A), random chunks (B) and a prefix then one token at a time (T) against the fp16 run F.

    fp16: the same K/V whatever the chunking, so only float32 rounding differs: |A-B|, |A-T| <= 1e-3.
    affine: every token is quantized on arrival, so the codes are the same too, except where float32 rounding
    (which depends on the chunking) moves a layer-1 value across a code boundary: we allow 1e-3 plus 5% of the
    scheme's own distance from fp16 (measured: 0.3% at 2 bits, 2.5% at 8 bits).
    kvarn (and the block schemes, whose blocks seal like records): a query reads as records only what was
    sealed before its update, so A (nothing sealed before the chunk) and each run up to its first record equal
    F to float rounding. B and T agree at every position before the first one whose query sees a different set
    of records (geometry from records.region_tokens, block_regions for the block schemes),
    to float rounding plus, as for affine, 5% of their distance from F (a layer-1 value that rounds to another
    fp16 number changes its record's codes; measured 1% at 2 bits). After it they may differ by what
    quantization changes, where one of them often reads a group in fp16 that the other reads as a record: we
    bound |B-T| by 1.5x the larger distance from F (measured up to 1.0002x in 80 examples).
    """
    low = spec.low  # at least one record can seal
    total = data.draw(st.integers(low, low + 140), "total")
    mx.random.seed(total)
    tokens = mx.random.randint(0, 300, (1, total))
    chunks = data.draw(chunkings(total), "chunks")
    prefix = data.draw(st.one_of(st.just(1), st.integers(max(1, total - 90), total - 1)), "prefix")
    steps = [prefix] + [1] * (total - prefix)
    f = model_logits(small, tokens, Spec("fp16", {}), [total])
    a = model_logits(small, tokens, spec, [total])
    b = model_logits(small, tokens, spec, chunks)
    t = model_logits(small, tokens, spec, steps)
    if spec.scheme == "fp16":
        assert max_diff(a, b) <= FLOAT_TOL and max_diff(a, t) <= FLOAT_TOL
    elif spec.scheme.startswith("affine"):
        tol = FLOAT_TOL + 0.05 * max_diff(a, f)
        assert max_diff(a, b) <= tol and max_diff(a, t) <= tol, (max_diff(a, b), max_diff(a, t), tol)
    else:
        assert max_diff(a, f) <= FLOAT_TOL
        seen_b, seen_t = records_seen(chunks, spec), records_seen(steps, spec)
        for run, seen in ((b, seen_b), (t, seen_t)):  # before a run's first record, it is the fp16 run
            clean = next((i for i in range(total) if seen[i]), total)
            assert max_diff(run[:, :clean], f[:, :clean]) <= FLOAT_TOL, clean
        eb, et = max_diff(b, f), max_diff(t, f)
        first = next((i for i in range(total) if seen_b[i] != seen_t[i]), total)
        assert max_diff(b[:, :first], t[:, :first]) <= FLOAT_TOL + 0.05 * max(eb, et), first
        assert max_diff(b, t) <= 1.5 * max(eb, et) + FLOAT_TOL, (max_diff(b, t), eb, et)


@examples(15)
@given(spec=specs(norm_iters=(2,)), data=st.data())
def test_changing_token_t_never_changes_earlier_logits(small, spec, data):
    """Exact: the logits before t are computed from the same numbers, whatever the scheme, chunking and t."""
    low = spec.low
    total = data.draw(st.integers(low, low + 100), "total")
    t = data.draw(st.integers(1, total - 1), "t")
    chunks = data.draw(chunkings(total, max_chunks=4), "chunks")
    mx.random.seed(total)
    tokens = mx.random.randint(0, 300, (1, total))
    changed = mx.concatenate([tokens[:, :t], (tokens[:, t:t + 1] + 1) % 300, tokens[:, t + 1:]], axis=1)
    a = model_logits(small, tokens, spec, chunks)
    b = model_logits(small, changed, spec, chunks)
    assert mx.array_equal(a[:, :t], b[:, :t]), max_diff(a[:, :t], b[:, :t])
    assert not mx.array_equal(a[:, t:], b[:, t:])


@examples(8)
@given(spec=specs(norm_iters=(2,)), data=st.data())
def test_batch_rows_equal_single_rows_through_a_model(small, spec, data):
    """Batch 2 of different prompts against each alone: the batched matmuls round differently in float32, so
    the same tolerance as chunking (1e-3 plus, for quantized schemes, 5% of the scheme's distance from fp16)."""
    low = spec.low
    total = data.draw(st.integers(low, low + 60), "total")
    chunks = data.draw(chunkings(total, max_chunks=4), "chunks")
    mx.random.seed(total)
    tokens = mx.random.randint(0, 300, (2, total))
    both = model_logits(small, tokens, spec, chunks)
    f = model_logits(small, tokens, Spec("fp16", {}), chunks)
    tol = FLOAT_TOL + (0.05 * max_diff(both, f) if spec.scheme != "fp16" else 0)
    for row in range(2):
        alone = model_logits(small, tokens[row:row + 1], spec, chunks)
        assert max_diff(both[row:row + 1], alone) <= tol


# -- mlx-lm's prompt-cache test patterns, for every scheme ------------------------------------------------------

MATRIX = [Spec(name, options) for name, options in registered()]  # every registered scheme (tests/schemes.py)


@pytest.mark.parametrize("spec", MATRIX, ids=repr)
def test_mlx_lm_save_load_with_metadata(spec, tmp_path):
    cache = [spec.make(layer=i) for i in range(4)]
    for i, c in enumerate(cache):
        k, v = kv(10 + 100 * i, seed=i)
        c.update_and_fetch(k, v)
    path = str(tmp_path / "prompt_cache.safetensors")
    save_prompt_cache(path, cache, {"a": "b", "c": "d"})
    loaded, metadata = load_prompt_cache(path, return_metadata=True)
    assert metadata == {"a": "b", "c": "d"} and len(loaded) == 4
    for c, lc in zip(cache, loaded):
        assert c.offset == lc.offset and c.layer == lc.layer
        assert_same_state(c, lc)


@pytest.fixture(scope="module")
def prompt():
    mx.random.seed(21)
    return mx.random.randint(0, 300, (300,))


def first(n: int, generator: Any) -> list:
    """The first n items of a generator, advancing it no further (mlx-lm's generate_step runs a step ahead)."""
    return [item for _, item in zip(range(n), generator)]


@pytest.mark.parametrize("spec", MATRIX, ids=repr)
def test_mlx_lm_generate_in_parts(small, prompt, spec):
    """Two tokens, then the third token fed to generation continued from the cache: the fourth token and its
    log-probabilities are those of four tokens generated in one go."""
    whole = gmlx_lab.make_cache(small, spec.scheme, quiet=True, **spec.options)
    reference = first(4, generate_step(prompt, small, prompt_cache=whole))
    cache = gmlx_lab.make_cache(small, spec.scheme, quiet=True, **spec.options)
    parts = list(generate_step(prompt, small, prompt_cache=cache, max_tokens=2))
    parts += list(generate_step(mx.array([reference[2][0]]), small, prompt_cache=cache, max_tokens=1))
    assert [t for t, _ in parts] == [reference[i][0] for i in (0, 1, 3)]
    assert all(mx.allclose(lp, reference[i][1]) for (_, lp), i in zip(parts, (0, 1, 3)))


@pytest.mark.parametrize("spec", MATRIX, ids=repr)
def test_mlx_lm_trim_prompt_cache(spec):
    cache = [spec.make() for _ in range(2)]
    for c in cache:
        c.update_and_fetch(*kv(10, seed=3))
    assert trim_prompt_cache(cache, 7) == 7
    assert trim_prompt_cache(cache, 4) == 3  # more than remain
    assert all(c.offset == 0 and c.empty() for c in cache)


@pytest.mark.parametrize("spec", MATRIX, ids=repr)
def test_mlx_lm_trim_cache_with_generate(small, prompt, spec):
    """Generate one token (the prompt is processed), two more, trim 3, generate again: the same tokens."""
    cache = gmlx_lab.make_cache(small, spec.scheme, quiet=True, **spec.options)
    last, _ = next(generate_step(prompt, small, prompt_cache=cache))
    last = mx.array([last])
    before = first(2, generate_step(last, small, prompt_cache=cache))
    assert trim_prompt_cache(cache, 3) == 3
    again = first(2, generate_step(last, small, prompt_cache=cache))
    assert [t for t, _ in before] == [t for t, _ in again]
    assert all(mx.allclose(a, b) for (_, a), (_, b) in zip(before, again))


@pytest.mark.parametrize("spec", MATRIX, ids=repr)
def test_mlx_lm_cache_copying(spec):
    cache = [spec.make()]
    x, y, z = kv(10, seed=1), kv(1, seed=2), kv(1, seed=3)
    cache[0].update_and_fetch(*x)
    cache[0].update_and_fetch(*y)
    old = copy.deepcopy(cache)
    trim_prompt_cache(cache, 1)
    assert old[0].offset == 11 and cache[0].offset == 10
    new_k, _ = cache[0].update_and_fetch(*z)
    old_k, _ = old[0].update_and_fetch(*z)
    fresh = spec.make()
    fresh.update_and_fetch(*x)
    fresh.update_and_fetch(*y)
    assert mx.array_equal(old_k, fresh.update_and_fetch(*z)[0])
    assert not mx.array_equal(new_k[:, :, 10], old_k[:, :, 10])


@pytest.mark.parametrize("spec", MATRIX, ids=repr)
def test_mlx_lm_make_mask_with_cache(spec):
    cache = spec.make()
    h4, h1 = mx.zeros((1, 4)), mx.zeros((1, 1))
    assert create_attention_mask(h4, cache=cache, return_array=False) == "causal"
    assert mx.array_equal(create_attention_mask(h4, cache=cache, return_array=True), create_causal_mask(4))
    assert create_attention_mask(h1, cache=cache) is None
    cache.update_and_fetch(*kv(32, seed=4))
    assert create_attention_mask(h4, cache=cache, return_array=True).shape == (4, 36)
    assert mx.array_equal(create_attention_mask(h1, cache, window_size=4), create_causal_mask(1, offset=32,
                                                                                             window_size=4))
    assert create_attention_mask(h1, cache=cache) is None

