"""Issue 12's defects, one test (or a parametrized group) each: odd but legal input that used to break.

1 causal prefill; 2 speculative decoding at every tail; 3 the command line's numeric arguments; 4 K and V
consistent after an error; 5 zero-length updates; 6 non-float K/V; 7 a string width; 8 constructors check
what the registry checks; 9 a shape change between updates; 10 a malformed config.json and empty model
names; 11 copy.deepcopy; and one non-finite policy for every scheme.
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import random_kv, tiny_llama
from mlx_lm.generate import speculative_generate_step

import gmlx_lab
from gmlx_lab import cli
from gmlx_lab.cache import AffineCache, AffineRotCache, FP16Cache, KvarnCache
from gmlx_lab.cache.base import FINITE_BATCH
from gmlx_lab.registry import get_scheme

ROOT = Path(__file__).resolve().parents[1]

# (scheme, options) for every scheme and width the causality test covers
CAUSAL_SCHEMES = (
    [("fp16", {})]
    + [(s, {"bits": b}) for s in ("affine", "affine_rot") for b in (2, 3, 4, 6, 8)]
    + [("kvarn", {"bits": b, "kv_tail_tokens": 0}) for b in (2, 3, 4, 5, 6, 8)]
    + [("kvarn", {"k_bits": 8, "v_bits": 2, "kv_tail_tokens": 0}),
       ("kvarn", {"k_bits": 2, "v_bits": 8, "kv_tail_tokens": 1}),
       ("kvarn", {"bits": 4, "kv_tail_tokens": 128})]
)


def one_layer_caches() -> list:
    """One cache of each class, the widths the tests below feed."""
    return [FP16Cache(layer=5), AffineCache(4, layer=5), AffineRotCache(3, layer=5),
            KvarnCache(4, 4, kv_tail_tokens=0, layer=5)]


def logits(model, tokens: mx.array, scheme: str, options: dict, chunks: list[int]) -> mx.array:
    """Logits of every position, the prompt fed in chunks of the given sizes through a fresh cache."""
    cache = gmlx_lab.make_cache(model, scheme, quiet=True, **options)
    out, start = [], 0
    for n in chunks:
        out.append(model(tokens[:, start:start + n], cache=cache))
        start += n
    assert start == tokens.shape[1]
    result = mx.concatenate(out, axis=1)
    mx.eval(result)
    return result


def with_token_changed(tokens: mx.array, t: int, vocab: int) -> mx.array:
    return mx.concatenate([tokens[:, :t], (tokens[:, t:t + 1] + 1) % vocab, tokens[:, t + 1:]], axis=1)


# -- 1: a causal prefill ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_model():
    return tiny_llama(layers=2)


@pytest.mark.parametrize("scheme, options", CAUSAL_SCHEMES, ids=lambda x: x if isinstance(x, str) else
                         ",".join(f"{k}={v}" for k, v in x.items()))
@pytest.mark.parametrize("split", ["one chunk", "chunks"])
def test_1_changing_token_t_never_changes_earlier_logits(small_model, scheme, options, split):
    """Token t is inside the first group of 128 that kvarn can seal (tokens 128-255); before the fix a record
    sealed inside the prefill chunk was normalized with t's statistics and attended by the queries before t."""
    length = 400 if options.get("kv_tail_tokens", 0) >= 128 else 260
    t = 200
    chunks = [length] if split == "one chunk" else [100, 50, length - 150]  # t and the group end in one chunk
    mx.random.seed(3)
    tokens = mx.random.randint(0, 300, (1, length))
    a = logits(small_model, tokens, scheme, options, chunks)
    b = logits(small_model, with_token_changed(tokens, t, 300), scheme, options, chunks)
    assert mx.array_equal(a[:, :t], b[:, :t]), float(mx.abs(a[:, :t] - b[:, :t]).max())
    assert not mx.array_equal(a[:, t:], b[:, t:])  # the change did reach the later positions


@pytest.fixture(scope="module")
def bundled():
    return gmlx_lab.load()


@pytest.mark.parametrize("scheme, options, chunks", [
    ("kvarn", {"bits": 4, "kv_tail_tokens": 0}, [400]),  # the case: up to 0.62 at positions 256-299
    ("kvarn", {"k_bits": 6, "v_bits": 3, "kv_tail_tokens": 1}, [290, 110]),
])
def test_1_causal_prefill_on_the_bundled_model(bundled, scheme, options, chunks):
    model, tokenizer = bundled
    text = (ROOT / "gmlx_lab" / "data" / "eval_text.txt").read_text(encoding="utf-8")
    tokens = mx.array(tokenizer.encode(text)[:400])[None]
    vocab = model.args.vocab_size
    a = logits(model, tokens, scheme, options, chunks)
    b = logits(model, with_token_changed(tokens, 300, vocab), scheme, options, chunks)
    assert mx.array_equal(a[:, :300], b[:, :300]), float(mx.abs(a[:, :300] - b[:, :300]).max())
    assert not mx.array_equal(a[:, 300:], b[:, 300:])


# -- 2: speculative decoding at every tail ------------------------------------------------------------------

class WrongEveryThird(nn.Module):
    """A draft model: the target itself (its own cache), except that every third token it proposes is wrong.

    Two tiny random models agree on nearly every token, so a real second model would never be rejected;
    this draft is rejected at every position modulo 3, so the target trims 1, 2 or 3 tokens after each group
    seals (before the fix, at tail 0: "cannot trim 3 tokens, only 0 can be rolled back").
    """

    def __init__(self, target: nn.Module):
        super().__init__()
        self.target = target
        self.layers = target.layers  # speculative_generate_step splits prompt_cache by len(model.layers)

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        out = self.target(inputs, cache=cache)
        return mx.roll(out, 1, axis=-1) if cache[0].offset % 3 == 0 else out


def teacher_forced_logprobs(model, prompt: mx.array, generated: list[int], scheme: str, options: dict) -> mx.array:
    """The log-probabilities plain greedy decoding computes for each generated token, given the tokens before it:
    the prompt but its last token in one chunk (as mlx-lm's generate_step), then one token at a time."""
    cache = gmlx_lab.make_cache(model, scheme, quiet=True, **options)
    model(prompt[None, :-1], cache=cache)
    feed = [int(prompt[-1])] + generated[:-1]
    rows = []
    for token in feed:
        out = model(mx.array([[token]]), cache=cache)[0, -1]
        rows.append(out - mx.logsumexp(out))
    return mx.stack(rows)


@pytest.mark.parametrize("tail, prompt_length", [(0, 250), (128, 378)])
def test_2_speculative_decoding_with_kvarn_at_every_tail(small_model, tail, prompt_length):
    """A draft is verified in one update; rejected tokens are trimmed, after records have sealed at this tail.

    What we assert, and why not plain token equality: the target verifies 1 + 3 tokens in one update, and a
    query reads as records only the groups that had left the tail before its update; one-at-a-time decoding
    reads those that had left it before the query's own token. So where a group leaves the tail inside a draft,
    a verified query sees in fp16 what plain decoding reads as a record (and the K/V that later layers store
    for it inherit that). A speculative query never sees more records than a plain one, so its distance from
    the fp16 run is about plain decoding's at most (`scale`: the plain run's largest log-probability change
    against fp16 at the same positions; measured 1.0x at both tails, we allow 1.5x), and by the triangle
    inequality it differs from plain decoding by at most 2x scale (measured 0.80x at tail 0 and 0.00004x at
    tail 128, where here no group left the tail inside a draft). A token may then differ from plain greedy
    decoding's only where plain decoding's top two are closer than twice the measured difference (a near
    tie); there is none here (the closest top two are 2.1 and 0.90 apart, twice the difference 0.25 and
    1e-5), so the tokens are equal. With fp16 the two agree to float32 rounding (the next test).
    """
    mx.random.seed(11)
    prompt = mx.random.randint(0, 300, (prompt_length,))
    draft = WrongEveryThird(small_model)
    options = {"bits": 4, "kv_tail_tokens": tail}
    cache = gmlx_lab.make_cache(small_model, "kvarn", quiet=True, **options)
    cache += gmlx_lab.make_cache(small_model, "kvarn", quiet=True, **options)  # the draft's
    steps = list(speculative_generate_step(prompt, small_model, draft, num_draft_tokens=3, max_tokens=24,
                                           prompt_cache=cache))
    tokens = [int(t) for t, _, _ in steps]
    assert len(tokens) == 24
    flags = "".join("d" if from_draft else "t" for _, _, from_draft in steps)
    assert "d" in flags and "ddd" not in flags  # drafts accepted, and rejected in every round
    assert cache[0].n_records >= 1  # sealed during the run: the prompt alone (one update) seals nothing
    spec = mx.stack([lp for _, lp, _ in steps])
    plain = teacher_forced_logprobs(small_model, prompt, tokens, "kvarn", options)
    fp16 = teacher_forced_logprobs(small_model, prompt, tokens, "fp16", {})
    diff = mx.abs(spec - plain).max(axis=-1)
    scale = float(mx.abs(plain - fp16).max())
    assert 0 < scale < 1.0, scale  # quantization did change something, and not much
    assert float(mx.abs(spec - fp16).max()) <= 1.5 * scale
    assert float(diff.max()) <= 2 * scale, (float(diff.max()), scale)
    for i, token in enumerate(tokens):
        best = int(mx.argmax(plain[i]))
        assert token == best or float(plain[i, best] - plain[i, token]) <= 2 * float(diff[i]), i
    assert tokens == [int(mx.argmax(plain[i])) for i in range(len(tokens))]  # no near tie on this model


def test_2_speculative_decoding_with_fp16_matches_plain_decoding_to_rounding(small_model):
    """The baseline for the tolerance above: with fp16 caches, verified positions differ from one-at-a-time
    decoding only by float32 rounding."""
    mx.random.seed(12)
    prompt = mx.random.randint(0, 300, (100,))
    cache = gmlx_lab.make_cache(small_model, "fp16", quiet=True) + gmlx_lab.make_cache(small_model, "fp16", quiet=True)
    steps = list(speculative_generate_step(prompt, small_model, WrongEveryThird(small_model), num_draft_tokens=3,
                                           max_tokens=12, prompt_cache=cache))
    tokens = [int(t) for t, _, _ in steps]
    plain = teacher_forced_logprobs(small_model, prompt, tokens, "fp16", {})
    assert float(mx.abs(mx.stack([lp for _, lp, _ in steps]) - plain).max()) < 1e-4
    assert tokens == [int(mx.argmax(plain[i])) for i in range(len(tokens))]


@pytest.mark.parametrize("tail, chunks, trim, more", [
    (128, [256, 128], 128, 1),  # hypothesis' shrunk case: the latest update pushed group 128-255 out of the tail
    (128, [502, 10], 10, 1),
    (200, [350, 112], 112, 3),
    (1, [250, 10], 10, 1),
    (0, [250, 10], 10, 1),
])
def test_2_trimming_the_latest_update_gives_back_the_cache_that_never_saw_it(tail, chunks, trim, more):
    """A rejected draft is trimmed: the cache must then be the one that never saw it, so the records and the
    tail are those of plain decoding (before: a group the draft pushed out of the tail stayed sealed)."""
    total = sum(chunks)
    k, v = random_kv(total + more, seed=6)
    drafted, never = KvarnCache(4, 4, kv_tail_tokens=tail), KvarnCache(4, 4, kv_tail_tokens=tail)
    start = 0
    for n in chunks:
        drafted.update_and_fetch(k[:, :, start:start + n], v[:, :, start:start + n])
        start += n
    kept = total - trim
    assert drafted.trim(trim) == trim
    got = drafted.update_and_fetch(k[:, :, total:], v[:, :, total:])
    never.update_and_fetch(k[:, :, :kept], v[:, :, :kept])
    expect = never.update_and_fetch(k[:, :, total:], v[:, :, total:])
    assert drafted.region_tokens() == never.region_tokens()
    assert drafted.region_tokens()["tail"] == min(tail, kept + more - 128)
    assert all(mx.array_equal(a, b) for a, b in zip(got, expect))


# -- 3: numeric command-line arguments -----------------------------------------------------------------------

def test_3_compare_max_tokens_negative_is_an_error_not_a_hang():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "gmlx_lab.cli", "compare", "--model", "llama", "--schemes", "fp16",
                           "--prompt", "hello", "--max-tokens", "-3"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "--max-tokens" in proc.stderr and "an int >= 1" in proc.stderr


@pytest.mark.parametrize("argv, name", [
    (["compare", "--max-tokens", "0"], "--max-tokens"),
    (["compare", "--prompt-tokens", "0"], "--prompt-tokens"),
    (["compare", "--prompt-tokens", "1.5"], "--prompt-tokens"),
    (["fidelity", "--prefill", "-1"], "--prefill"),
    (["fidelity", "--decode", "0"], "--decode"),
    (["fidelity", "--prefill-step", "0"], "--prefill-step"),
    (["fidelity", "--prefill", "x"], "--prefill"),
    (["memory", "--context", "0"], "--context"),
    (["memory", "--context", "-4096"], "--context"),
])
def test_3_every_numeric_argument_is_checked(argv, name, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--model", "llama"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("gmlx-lab: error: ") and f"argument {name}:" in err and "accepted: an int >= 1" in err


# -- 4: K and V stay consistent when an error interrupts -----------------------------------------------------

def test_4_kvarn_k_and_v_agree_after_a_non_finite_error():
    """Non-finite V inside a group that later seals: the error comes, and K and V still hold the same tokens
    (before: K sealed, V refused, and trim(10) left K with 291 tokens and V with 163)."""
    k, v = random_kv(700, seed=4)
    v = mx.where((mx.arange(700) == 310)[None, None, :, None], mx.nan, v)
    cache = KvarnCache(4, 4, kv_tail_tokens=0, layer=2)
    start = 0
    with pytest.raises(ValueError, match="layer 2: non-finite keys or values"):
        for n in [300, 40, 100, 100, 100, 60]:
            cache.update_and_fetch(k[:, :, start:start + n], v[:, :, start:start + n])
            start += n
        cache.check_finite()
    for trim in (0, 10):
        cache.trim(trim)
        kk, vv = cache.fetch()
        regions = cache.region_tokens()
        assert kk.shape[2] == vv.shape[2] == cache.offset == sum(regions.values())
        assert cache.records.k.count == cache.records.v.count == regions["body"] // 128
        sink_k, sink_v, body_k, body_v, recent_k, recent_v = cache.state[:6]
        assert sink_k.shape[2] == sink_v.shape[2] and recent_k.shape[2] == recent_v.shape[2]
        assert all(a.shape[2] == b.shape[2] for a, b in zip(body_k, body_v))


# -- 5, 6, 9: what arrives is checked, with the layer named --------------------------------------------------

@pytest.mark.parametrize("cache", one_layer_caches(), ids=lambda c: c.scheme)
def test_5_zero_length_update_is_a_named_error(cache):
    k, v = random_kv(0)
    with pytest.raises(ValueError, match="layer 5: an update with 0 tokens"):
        cache.update_and_fetch(k, v)
    assert cache.offset == 0 and cache.nbytes == 0


@pytest.mark.parametrize("dtype", [mx.int32, mx.uint8, mx.bool_])
@pytest.mark.parametrize("cache", one_layer_caches(), ids=lambda c: c.scheme)
def test_6_non_float_kv_is_a_named_error(cache, dtype):
    k, v = random_kv(10)
    with pytest.raises(TypeError, match=f"layer 5: keys have dtype .*{dtype}.*accepted: float16, bfloat16, float32"):
        cache.update_and_fetch(k.astype(dtype), v)
    with pytest.raises(TypeError, match="layer 5: values have dtype"):
        cache.update_and_fetch(k, v.astype(dtype))
    assert cache.offset == 0


@pytest.mark.parametrize("change, message", [
    ({"dim": 256}, "key head_dim 128 -> 256, value head_dim 128 -> 256"),
    ({"heads": 4}, "kv heads 2 -> 4"),
    ({"batch": 2}, "batch 1 -> 2"),
])
@pytest.mark.parametrize("make", [lambda: FP16Cache(layer=5), lambda: AffineCache(4, group_size=32, layer=5),
                                  lambda: AffineRotCache(4, layer=5),
                                  lambda: KvarnCache(4, 4, kv_tail_tokens=0, layer=5)],
                         ids=["fp16", "affine", "affine_rot", "kvarn"])
def test_9_shape_change_between_updates_is_a_named_error(make, change, message):
    cache = make()
    cache.update_and_fetch(*random_kv(300))
    k, v = random_kv(3, heads=change.get("heads", 2), dim=change.get("dim", 128))
    if "batch" in change:
        k, v = mx.concatenate([k, k]), mx.concatenate([v, v])
    with pytest.raises(ValueError, match=f"layer 5: K/V shape changed between updates \\({message}\\)"):
        cache.update_and_fetch(k, v)
    assert cache.offset == 300
    cache.update_and_fetch(*random_kv(3, seed=1))  # the cache still works
    assert cache.offset == 303


# -- 7, 8: constructors check what the registry checks -------------------------------------------------------

def test_7_a_string_width_says_it_must_be_an_int():
    with pytest.raises(ValueError, match="bits='4' must be an int") as exc:
        AffineCache(bits="4")
    assert "is not supported" not in str(exc.value)
    with pytest.raises(ValueError, match="k_bits='6' must be an int"):
        KvarnCache(k_bits="6")


@pytest.mark.parametrize("make", [
    lambda: KvarnCache(kv_tail_tokens=True),
    lambda: KvarnCache(norm_iters=-1),
    lambda: KvarnCache(v_bits=7),
    lambda: KvarnCache(kv_tail_tokens=12.0),
    lambda: AffineCache(quantized_kv_start=-5),
    lambda: AffineCache(group_size=16),
    lambda: AffineRotCache(bits=5),
    lambda: AffineCache(bits=4.0),
])
def test_8_constructors_reject_what_the_registry_rejects(make):
    with pytest.raises(ValueError, match="must be an int|is not supported"):
        make()


VALUES = [True, False, None, "4", 4.0, -5, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 100, 128, 129, 1024]


@pytest.mark.parametrize("scheme, option", [("affine", "bits"), ("affine", "group_size"),
                                            ("affine", "quantized_kv_start"), ("affine_rot", "bits"),
                                            ("kvarn", "k_bits"), ("kvarn", "v_bits"), ("kvarn", "kv_tail_tokens"),
                                            ("kvarn", "norm_iters")])
def test_8_constructor_and_registry_accept_the_same_values(scheme, option):
    """One place decides: for every value, the cache constructor accepts it exactly when the registry does (None
    is the default in both)."""
    make = {"affine": AffineCache, "affine_rot": AffineRotCache, "kvarn": KvarnCache}
    for value in VALUES:
        try:
            get_scheme(scheme).resolve(**{option: value})
            registry_ok = True
        except ValueError:
            registry_ok = False
        try:
            make[scheme](**{option: value})
            constructor_ok = True
        except ValueError:
            constructor_ok = False
        assert constructor_ok == registry_ok, (option, value)


# -- 10: a malformed config.json, an empty model name ---------------------------------------------------------

def test_10_malformed_config_names_the_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama", ')
    assert cli.main(["policy", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert str(tmp_path / "config.json") in err and "not valid JSON" in err and "line 1" in err


def test_10_folder_without_config_names_the_file(tmp_path, capsys):
    assert cli.main(["policy", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "config.json") in err and len(err.strip().splitlines()) == 1


def test_10_config_that_is_not_an_object_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(["llama"]))
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}.*JSON object"):
        gmlx_lab.load(str(tmp_path))


@pytest.mark.parametrize("name", ["", " ", "\t\n"])
def test_10_empty_model_names_are_rejected(name, capsys):
    with pytest.raises(ValueError, match="empty model name.*accepted: None or 'teaching-llama'.*smollm2-135m"):
        gmlx_lab.load(name)
    assert cli.main(["compare", "--model", name, "--prompt", "x"]) == 2
    assert "empty model name" in capsys.readouterr().err


def test_10_model_name_of_the_wrong_type_is_rejected():
    with pytest.raises(TypeError, match="model name must be a str or a path, got int"):
        gmlx_lab.load(3)


# -- 11: copy.deepcopy ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens", [10, 255, 256, 300])
@pytest.mark.parametrize("make", [lambda: FP16Cache(), lambda: AffineCache(4), lambda: AffineRotCache(8),
                                  lambda: KvarnCache(4, 4, kv_tail_tokens=0),
                                  lambda: KvarnCache(4, 4, kv_tail_tokens=128)],
                         ids=["fp16", "affine", "affine_rot", "kvarn_tail0", "kvarn_tail128"])
def test_11_deepcopy_is_independent_of_its_original(make, tokens):
    """mlx-lm's test_cache_copying, at several offsets: 256 tokens fill a buffer exactly, the case where a copy
    shared the original's buffer and the original's next in-place write (after a trim) changed the copy."""
    k, v = random_kv(tokens + 1)
    cache = make()
    cache.update_and_fetch(k[:, :, :tokens - 1], v[:, :, :tokens - 1])
    cache.update_and_fetch(k[:, :, tokens - 1:tokens], v[:, :, tokens - 1:tokens])
    old = copy.deepcopy(cache)
    expect_k, expect_v = copy.deepcopy(cache).update_and_fetch(k[:, :, tokens:], v[:, :, tokens:])
    assert cache.trim(1) == 1 and old.offset == tokens
    cache.update_and_fetch(k[:, :, tokens:] + 3, v[:, :, tokens:] + 3)  # overwrites the trimmed position
    got_k, got_v = old.update_and_fetch(k[:, :, tokens:], v[:, :, tokens:])
    assert mx.array_equal(got_k, expect_k) and mx.array_equal(got_v, expect_v)


def test_11_deepcopy_of_a_prompt_cache_keeps_the_policy(model):
    cache = gmlx_lab.make_cache(model, "kvarn", quiet=True, kv_tail_tokens=0)
    model(mx.arange(200)[None], cache=cache)
    twin = copy.deepcopy(cache)
    assert type(twin) is type(cache) and twin.policy is cache.policy  # the model is not copied
    assert [type(c) for c in twin] == [type(c) for c in cache] and twin[0] is not cache[0]
    step = mx.array([[7]])
    assert mx.array_equal(model(step, cache=cache), model(step, cache=twin))


# -- non-finite K/V: one policy for every scheme -------------------------------------------------------------

@pytest.mark.parametrize("cache", one_layer_caches(), ids=lambda c: c.scheme)
def test_non_finite_kv_is_one_named_error_for_every_scheme(cache):
    """inf or nan in arriving K or V raises a ValueError naming the layer and tokens: at once on check_finite(),
    and by itself within three batches of FINITE_BATCH tokens while decoding (before: fp16 passed nan through,
    affine turned it into finite values, kvarn raised when the token was sealed, perhaps 1000 tokens later)."""
    k, v = random_kv(400, seed=5)
    cache.update_and_fetch(k[:, :, :40], v[:, :, :40])
    bad_k = mx.where((mx.arange(8) == 3)[None, None, :, None], mx.inf, k[:, :, 40:48])
    cache.update_and_fetch(bad_k, v[:, :, 40:48])
    twin = copy.deepcopy(cache)
    with pytest.raises(ValueError, match="layer 5: non-finite keys or values .* in tokens 40..47"):
        cache.check_finite()
    raised_at = None
    for t in range(48, 400):
        try:
            twin.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        except ValueError as err:
            assert "layer 5: non-finite keys or values" in str(err)
            raised_at = t
            break
    assert raised_at is not None and raised_at < 48 + 3 * FINITE_BATCH
    assert twin.offset == raised_at  # the update that reported it was not stored


@pytest.mark.parametrize("cache", one_layer_caches(), ids=lambda c: c.scheme)
def test_non_finite_check_can_be_switched_off_by_name(cache):
    """Off, arriving K/V are not checked; an explicit check_finite() still scans what the cache holds."""
    cache.check_finite_on = False
    k, v = random_kv(200)
    cache.update_and_fetch(k[:, :, :100], v[:, :, :100] * mx.nan)
    for t in range(100, 200):  # past three finiteness batches: nothing was queued, nothing raises
        cache.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert cache.offset == 200
    with pytest.raises(ValueError, match="layer 5: V in the .* holds inf or nan"):
        cache.check_finite()
