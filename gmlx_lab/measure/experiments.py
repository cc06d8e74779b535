"""Beyond KL: task-level checks of a quantized KV cache (issue 17).

Teacher-forced KL (gmlx_lab.fidelity) says how far the next-token distribution moves. The three
experiments here ask what breaks:

    passkey(model, tokenizer, ["fp16", "affine2", "kvarn2:tail=0"], lengths=[1024, 2048])
        a passkey hidden at a depth in filler text: does the greedy answer still recall it?
    draft_acceptance(model, tokenizer, layer_skip_draft(model, 6), ["fp16", "affine4", "kvarn4:tail=0"])
        speculative decoding (mlx-lm's `speculative_generate_step`) with the target's cache quantized:
        how many drafted tokens the target still accepts
    weights_and_kv(model, tokens, weight_bits=(None, 8, 4, 3), kv_schemes=["fp16", "affine4", "kvarn4:tail=0"])
        KL against fp16 weights with an fp16 cache, for weights quantized as `nn.quantize` does, under each
        cache: do weight and KV errors compound?

Every run goes through `gmlx_lab.policy`, so the model's own per-layer policy applies (on Gemma 3 270M
only global layers 5 and 11 quantize: the sliding-window layers and the last layer stay fp16).
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from ..policy import Policy, PromptCache, model_name, policy
from ..registry import BASELINE, get_scheme
from ..specs import SchemeLike, read_scheme_spec
from .metrics import kl_from_logprobs

__all__ = [
    "PASSKEY_FORMAT", "DraftResult", "DraftRun", "PasskeyFormat", "PasskeyPrompt", "PasskeyResult", "PasskeyTrial",
    "WeightsKVResult", "choose_policy", "decode_logprobs", "draft_acceptance", "greedy_tokens", "layer_skip_draft",
    "needle_storage", "passkey", "passkey_prompt", "prefill", "quantize_weights", "random_key", "recall_counts",
    "sliding_window", "speculative_run", "stored_prefix", "weights_and_kv",
]


# -- shared pieces ----------------------------------------------------------------------------------


def choose_policy(model: nn.Module, item: SchemeLike) -> Policy:
    """The policy of a spec ("kvarn4:tail=0"), a (scheme, options) pair, or a ready Policy."""
    if isinstance(item, Policy):
        return item
    scheme, options = read_scheme_spec(item)
    return policy(model, scheme, **options)


def prefill(model: nn.Module, ids: Sequence[int], cache: PromptCache | list, step: int = 2048) -> None:
    """Run `ids` through the model into `cache` in chunks of `step`, without computing logits.

    As mlx-lm's own prefill does, only the caches are evaluated, so the vocabulary projection
    (most of the work for Gemma's 262,144-token head) is never computed.
    """
    for start in range(0, len(ids), step):
        model(mx.array([list(ids[start:start + step])]), cache=cache)
        mx.eval([c.state for c in cache])


def stored_prefix(reference: PromptCache, chosen: Policy) -> PromptCache:
    """`chosen`'s caches holding the K/V that an fp16 `reference` cache holds, sealed.

    Each layer the policy quantizes receives the reference's K/V as ONE update and is then sealed
    (`PromptCache.settle`); every other entry is an independent copy of the reference's. For kvarn this is
    exactly what a one-chunk prefill through its own cache stores (that chunk attends in fp16; records are
    sealed when the next tokens arrive). Affine would also have attended to its own codes during the
    prefill, so deeper layers' K/V would carry that error too; here every scheme stores the same K/V, and
    only the tokens that come after (a question, an answer) read them back quantized.
    """
    out = chosen.make_cache()
    for i, (ref, decision) in enumerate(zip(reference, chosen.layers)):
        if decision.decision == BASELINE:
            out[i] = copy.deepcopy(ref)
        else:
            keys, values = ref.state[:2]
            if keys.shape[-2] != ref.offset:  # a rolling window dropped tokens: positions would not line up
                raise ValueError(f"layer {i}: the fp16 reference holds {keys.shape[-2]} of its {ref.offset} tokens "
                                 "(a sliding window after a prefill of several chunks), so its K/V cannot be stored "
                                 "as one update; prefill through each scheme's own cache (share_prefill=False)")
            out[i].update_and_fetch(keys, values)
    out.settle()
    return out


def greedy_tokens(model: nn.Module, ids: Sequence[int], cache: PromptCache | list, n: int) -> list[int]:
    """`n` greedy tokens after feeding `ids` (one update) into `cache`."""
    logits = model(mx.array([list(ids)]), cache=cache)
    out: list[int] = []
    for _ in range(n):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        if len(out) < n:
            logits = model(mx.array([[token]]), cache=cache)
    return out


# -- 1. passkey retrieval ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PasskeyFormat:
    """The text of a passkey prompt: an intro, a filler unit repeated, the needle, the question."""

    intro: str
    filler: str
    needle: str  # with {key}
    question: str


PASSKEY_FORMAT = PasskeyFormat(
    intro="There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there.\n",
    filler="The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n",
    needle="The pass key is {key}. Remember it. {key} is the pass key.\n",
    question="What is the pass key? The pass key is",
)


@dataclass(frozen=True)
class PasskeyPrompt:
    """One passkey prompt as token ids: `context` (BOS, intro, filler with the needle) then `question`."""

    key: str
    context: list[int]
    question: list[int]
    needle_start: int  # token index of the needle in `context`
    key_start: int  # token index right after the needle's opening words: the key (or the space before it)

    @property
    def length(self) -> int:
        """Tokens of the whole prompt (context and question)."""
        return len(self.context) + len(self.question)

    @property
    def position(self) -> float:
        """Where the needle starts, as a share of the context (the intro included)."""
        return self.needle_start / len(self.context)

    @property
    def distance(self) -> int:
        """Tokens from the key to the end of the prompt: past a sliding window, only global layers can see it."""
        return self.length - self.key_start


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def passkey_prompt(tokenizer: Any, length: int, depth: float, key: str,
                   fmt: PasskeyFormat = PASSKEY_FORMAT) -> PasskeyPrompt:
    """A prompt of about `length` tokens (whole filler units, so within one unit of it), the needle after
    the share `depth` of the filler units (0: right after the intro, 1: just before the question).

    The pieces are tokenized apart and joined, so the needle sits exactly between two filler units
    and its tokens are the same at every depth and length.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be between 0 and 1, got {depth}")
    bos = getattr(tokenizer, "bos_token_id", None)
    intro = ([bos] if bos is not None else []) + _ids(tokenizer, fmt.intro)
    unit, needle = _ids(tokenizer, fmt.filler), _ids(tokenizer, fmt.needle.format(key=key))
    question = _ids(tokenizer, fmt.question)
    units = (length - len(intro) - len(needle) - len(question)) // len(unit)
    if units < 1:
        raise ValueError(f"length {length} is too short: the intro, needle and question alone take "
                         f"{len(intro) + len(needle) + len(question)} tokens")
    before = round(depth * units)
    context = intro + unit * before + needle + unit * (units - before)
    start = len(intro) + len(unit) * before
    key_start = start + len(_ids(tokenizer, fmt.needle.split("{key}")[0].rstrip()))
    return PasskeyPrompt(key, context, question, start, key_start)


def random_key(rng: np.random.Generator, digits: int = 5) -> str:
    """A random passkey of `digits` digits (no leading zero)."""
    return str(rng.integers(1, 10)) + "".join(str(d) for d in rng.integers(0, 10, digits - 1))


@dataclass
class PasskeyTrial:
    """One prompt under one scheme: the greedy answer, whether it holds the key, where the needle was stored."""

    label: str
    length: int  # the length asked for (the grid's column)
    depth: float  # the depth asked for (the grid's row)
    tokens: int  # the prompt's real length
    distance: int  # tokens from the key to the end of the prompt
    key: str
    answer: str
    correct: bool
    needle_stored: str  # kvarn: the region holding the needle ("sink", "records", "live", "tail"); else fp16/quantized


def needle_storage(chosen: Policy, prompt: PasskeyPrompt) -> str:
    """Where the scheme holds the needle's K/V when the question attends to them (in a quantized layer)."""
    if not chosen.quantized:
        return BASELINE
    scheme = get_scheme(chosen.scheme)
    return scheme.token_region(prompt.key_start, prompt.length, len(prompt.question), chosen.options)


def sliding_window(model: nn.Module) -> int | None:
    """The model's smallest sliding window (its RotatingKVCache size), None if it has none."""
    sizes = [c.max_size for c in make_prompt_cache(model) if isinstance(c, RotatingKVCache)]
    return min(sizes) if sizes else None


@dataclass
class PasskeyResult:
    """Every trial of a passkey run, with accuracy grids (depth x length) per scheme."""

    model: str
    labels: list[str]
    policies: dict[str, str]  # label -> the [kv] line
    lengths: list[int]
    depths: list[float]
    keys_per_cell: int
    share_prefill: bool
    window: int | None  # the model's sliding window: keys farther than this from the question need global layers
    trials: list[PasskeyTrial] = field(default_factory=list)
    seconds: float = 0.0

    def grid(self, label: str) -> np.ndarray:
        """Accuracy (0..1) of one scheme: rows are depths, columns lengths."""
        out = np.zeros((len(self.depths), len(self.lengths)))
        for i, d in enumerate(self.depths):
            for j, n in enumerate(self.lengths):
                hits = [t.correct for t in self.trials if t.label == label and t.depth == d and t.length == n]
                out[i, j] = np.mean(hits) if hits else np.nan
        return out

    def accuracy(self, label: str) -> float:
        """Share of all trials of one scheme that recalled the key."""
        return float(np.mean([t.correct for t in self.trials if t.label == label]))

    def accuracy_beyond_window(self, label: str) -> float:
        """Share of a scheme's trials that recalled a key farther from the question than the sliding window."""
        hits = [t.correct for t in self.trials if t.label == label and self.window and t.distance > self.window]
        return float(np.mean(hits)) if hits else float("nan")

    def stored_in(self, label: str) -> dict[str, int]:
        """How many of a scheme's trials held the needle in each region."""
        out: dict[str, int] = {}
        for t in self.trials:
            if t.label == label:
                out[t.needle_stored] = out.get(t.needle_stored, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "labels": self.labels, "policies": self.policies, "lengths": self.lengths,
                "depths": self.depths, "keys_per_cell": self.keys_per_cell, "share_prefill": self.share_prefill,
                "window": self.window, "seconds": round(self.seconds, 1),
                "accuracy": {label: self.accuracy(label) for label in self.labels},
                "accuracy_beyond_window": {label: _none_if_nan(self.accuracy_beyond_window(label))
                                           for label in self.labels},
                "grids": {label: self.grid(label).tolist() for label in self.labels},
                "trials": [asdict(t) for t in self.trials]}

    def to_markdown(self) -> str:
        """One row per scheme: accuracy overall, per length and past the sliding window; where the needle was kept."""
        beyond = f" key > {self.window} tokens back |" if self.window else ""
        lengths = " | ".join(f"{n} tokens" for n in self.lengths)
        head = f"| scheme | accuracy | {lengths} |{beyond} needle stored |"
        rows = [head, "|" + "---|" * (len(self.lengths) + 3 + bool(self.window))]
        for label in self.labels:
            g = self.grid(label)
            per_length = " | ".join(f"{100 * np.nanmean(g[:, j]):.0f}%" for j in range(len(self.lengths)))
            far = f" {_pct(self.accuracy_beyond_window(label))} |" if self.window else ""
            stored = ", ".join(f"{k} {v}" for k, v in self.stored_in(label).items())
            rows.append(f"| {label} | {100 * self.accuracy(label):.0f}% | {per_length} |{far} {stored} |")
        return "\n".join(rows) + (f"\n\n{self.model}: needle depths {self.depths}, {self.keys_per_cell} key(s) per "
                                  "cell, greedy answer; needle stored: the region that held the key in the quantized "
                                  "layers (kvarn) when the question arrived")

    def _repr_markdown_(self) -> str:
        return self.to_markdown()


def recall_counts(result: PasskeyResult | dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(keys recalled, keys asked) per scheme of a passkey run: a PasskeyResult or its `to_dict()`, as the
    committed benchmarks/results files store it. Counts, not rates: a run holds a handful of keys per scheme."""
    data = result.to_dict() if isinstance(result, PasskeyResult) else result
    if "trials" not in data or "labels" not in data:
        raise ValueError("not a passkey result: expected PasskeyResult or its to_dict() (with 'labels' and 'trials')")
    out = {label: (0, 0) for label in data["labels"]}
    for t in data["trials"]:
        hits, asked = out[t["label"]]
        out[t["label"]] = (hits + bool(t["correct"]), asked + 1)
    return out


def _pct(x: float) -> str:
    return "-" if np.isnan(x) else f"{100 * x:.0f}%"


def _none_if_nan(x: float) -> float | None:
    return None if np.isnan(x) else x


def passkey(
    model: nn.Module,
    tokenizer: Any,
    schemes: Iterable[SchemeLike] = ("fp16", "affine2", "kvarn2:tail=0"),
    lengths: Sequence[int] = (1024, 2048),
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    *,
    keys_per_cell: int = 1,
    digits: int = 5,
    seed: int = 0,
    fmt: PasskeyFormat = PASSKEY_FORMAT,
    share_prefill: bool = True,
    prefill_step: int = 2048,
    progress: bool = False,
) -> PasskeyResult:
    """Passkey retrieval per scheme over a grid of depths x lengths: is the key in the greedy answer?

    Each cell draws `keys_per_cell` random keys (the same for every scheme). The context (intro,
    filler, needle) is prefilled, the cache sealed, then the question is fed as one update and
    `digits` + 2 tokens are decoded greedily; the answer is correct when its first run of digits is the key.
    With `share_prefill` (default) the context runs once through fp16 caches and each scheme stores those
    K/V (`stored_prefix`); otherwise each scheme prefills through its own cache in chunks of `prefill_step`.
    """
    policies = [choose_policy(model, s) for s in schemes]
    labels = [p.label for p in policies]
    if len(set(labels)) != len(labels):
        raise ValueError(f"schemes repeat: {labels}")
    result = PasskeyResult(model_name(model), labels, {p.label: str(p) for p in policies}, list(lengths),
                           list(depths), keys_per_cell, share_prefill, sliding_window(model))
    reference = policy(model, "fp16")
    rng = np.random.default_rng(seed)
    cells = [(n, d) for n in lengths for d in depths for _ in range(keys_per_cell)]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(cells) * len(policies), desc="passkey", leave=False)
    start = time.perf_counter()
    for n, d in cells:
        prompt = passkey_prompt(tokenizer, n, d, random_key(rng, digits), fmt)
        if share_prefill:
            shared = reference.make_cache()
            prefill(model, prompt.context, shared, prefill_step)
        for chosen in policies:
            if share_prefill:
                cache = stored_prefix(shared, chosen)
            else:
                cache = chosen.make_cache()
                prefill(model, prompt.context, cache, prefill_step)
                cache.settle()
            answer = tokenizer.decode(greedy_tokens(model, prompt.question, cache, digits + 2))
            found = re.search(r"\d+", answer)
            result.trials.append(PasskeyTrial(chosen.label, n, d, prompt.length, prompt.distance, prompt.key,
                                              answer, found is not None and found.group() == prompt.key,
                                              needle_storage(chosen, prompt)))
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    result.seconds = time.perf_counter() - start
    return result


# -- 2. draft acceptance ----------------------------------------------------------------------------


def layer_skip_draft(model: nn.Module, n_layers: int) -> nn.Module:
    """A draft model made of the target's embedding, its first `n_layers` blocks and its final norm and head.

    Nothing is copied or trained: the draft is a shallow copy of the mlx-lm model object whose layer list
    is cut, so it shares every weight with the target and costs no memory; `make_prompt_cache(draft)` gives
    it caches of its own. It works for mlx-lm models laid out as `model.model.layers` (llama, gemma3, ...).
    Gemma 3 needs n_layers >= 6: its model reads the attention mask from its first global layer's cache (5).
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, list):
        raise ValueError(f"{model_name(model)}: a layer-skipping draft needs an mlx-lm model with model.model.layers")
    if not 1 <= n_layers <= len(layers):
        raise ValueError(f"n_layers must be between 1 and {len(layers)}, got {n_layers}")
    draft = copy.copy(model)
    draft.model = copy.copy(inner)
    draft.model.layers = layers[:n_layers]
    for obj in (draft, draft.model):
        if hasattr(obj, "num_hidden_layers"):
            obj.num_hidden_layers = n_layers
        args = getattr(obj, "args", None)
        if hasattr(args, "num_hidden_layers"):  # make_cache reads it (gemma3)
            obj.args = replace(args, num_hidden_layers=n_layers)
    cache = make_prompt_cache(draft)
    try:
        mx.eval(draft(mx.array([[0]]), cache=cache))
    except IndexError as exc:
        raise ValueError(f"{model_name(model)} cannot run on its first {n_layers} layers ({exc}); "
                         "try more layers") from None
    if len(cache) != n_layers:
        raise ValueError(f"the draft made {len(cache)} caches for {n_layers} layers")
    draft.gmlx_name = f"{model_name(model)} layers 0-{n_layers - 1}"
    return draft


@dataclass
class DraftRun:
    """Speculative decoding with one target cache scheme: drafted and accepted tokens, verify steps."""

    label: str
    policy: str
    drafted: int
    accepted: int
    steps: int  # target forward passes after the prompt (one per verify step)
    tokens: int
    seconds: float
    texts: list[str]

    @property
    def acceptance(self) -> float:
        """Share of drafted tokens the target accepted."""
        return self.accepted / max(self.drafted, 1)

    @property
    def tokens_per_step(self) -> float:
        """Tokens produced per target forward pass (1 without speculation, at most num_draft_tokens + 1)."""
        return self.tokens / max(self.steps, 1)

    def summary(self) -> dict[str, Any]:
        return {"label": self.label, "acceptance": self.acceptance, "tokens_per_step": self.tokens_per_step,
                "drafted": self.drafted, "accepted": self.accepted, "steps": self.steps, "tokens": self.tokens,
                "seconds": round(self.seconds, 2)}


@dataclass
class DraftResult:
    """Draft acceptance per target cache scheme, with the setup."""

    model: str
    draft: str
    num_draft_tokens: int
    prompt_tokens: list[int]
    max_tokens: int
    runs: list[DraftRun] = field(default_factory=list)

    def __getitem__(self, label: str) -> DraftRun:
        for r in self.runs:
            if r.label == label:
                return r
        raise KeyError(label)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "draft": self.draft, "num_draft_tokens": self.num_draft_tokens,
                "prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens,
                "runs": [{**r.summary(), "policy": r.policy, "texts": r.texts} for r in self.runs]}

    def to_markdown(self) -> str:
        rows = ["| target cache | acceptance | tokens per step | accepted / drafted | steps |", "|---|---|---|---|---|"]
        for r in self.runs:
            rows.append(f"| {r.label} | {100 * r.acceptance:.1f}% | {r.tokens_per_step:.2f} "
                        f"| {r.accepted} / {r.drafted} | {r.steps} |")
        return "\n".join(rows) + (f"\n\n{self.model} verifying {self.draft} (fp16 cache), {self.num_draft_tokens} "
                                  f"draft tokens per step, {self.max_tokens} greedy tokens after each of "
                                  f"{len(self.prompt_tokens)} prompts ({', '.join(map(str, self.prompt_tokens))} "
                                  "tokens)")

    def _repr_markdown_(self) -> str:
        return self.to_markdown()


def speculative_run(model: nn.Module, draft: nn.Module, prompt: Sequence[int], target_cache: PromptCache | list,
                    draft_cache: list, num_draft_tokens: int, max_tokens: int) -> tuple[list[int], int, int, int]:
    """One greedy `speculative_generate_step` run: (tokens, drafted, accepted, verify steps).

    mlx-lm takes both caches as one list, the target's first; they stay separate objects, so the
    target's scheme never touches the draft's fp16 cache.
    """
    from mlx_lm.generate import speculative_generate_step

    if len(target_cache) != len(model.layers) or len(draft_cache) != len(draft.layers):
        raise ValueError("one cache entry per layer is needed for the target and for the draft")
    if {id(c) for c in target_cache} & {id(c) for c in draft_cache}:
        raise ValueError("the draft and the target must not share cache entries")
    tokens: list[int] = []
    drafted = accepted = steps = 0
    step_start = True
    for token, _, from_draft in speculative_generate_step(
            mx.array(list(prompt)), model, draft, num_draft_tokens=num_draft_tokens, max_tokens=max_tokens,
            prompt_cache=list(target_cache) + list(draft_cache)):
        if step_start:  # a verify step begins: it drafted min(what is left, num_draft_tokens) tokens
            steps += 1
            drafted += min(max_tokens - len(tokens), num_draft_tokens)
        tokens.append(int(token))
        accepted += bool(from_draft)
        step_start = not from_draft
    return tokens, drafted, accepted, steps


def draft_acceptance(
    model: nn.Module,
    tokenizer: Any,
    draft: nn.Module,
    schemes: Iterable[SchemeLike] = ("fp16", "affine4", "kvarn4:tail=0"),
    prompts: Sequence[Sequence[int]] = (),
    *,
    num_draft_tokens: int = 3,
    max_tokens: int = 64,
) -> DraftResult:
    """Acceptance rate and tokens per verify step of `draft` against the target under each cache scheme.

    Greedy speculative decoding (mlx-lm's `speculative_generate_step`) after each prompt (token ids);
    the target's cache follows the scheme's policy, the draft's cache is always the model's own fp16 one.
    Past its sliding window a Gemma 3 cache cannot be trimmed, so prompt + max_tokens must stay below it.
    """
    if not prompts:
        raise ValueError("draft_acceptance needs at least one prompt (token ids)")
    result = DraftResult(model_name(model), model_name(draft), num_draft_tokens, [len(p) for p in prompts],
                         max_tokens)
    for item in schemes:
        chosen = choose_policy(model, item)
        drafted = accepted = steps = produced = 0
        texts = []
        start = time.perf_counter()
        for prompt in prompts:
            tokens, d, a, s = speculative_run(model, draft, prompt, chosen.make_cache(), make_prompt_cache(draft),
                                              num_draft_tokens, max_tokens)
            drafted, accepted, steps, produced = drafted + d, accepted + a, steps + s, produced + len(tokens)
            texts.append(tokenizer.decode(tokens) if tokenizer is not None else " ".join(map(str, tokens)))
        result.runs.append(DraftRun(chosen.label, str(chosen), drafted, accepted, steps, produced,
                                    time.perf_counter() - start, texts))
    return result


# -- 3. KV on quantized weights ---------------------------------------------------------------------


WEIGHT_BITS = (2, 3, 4, 5, 6, 8)  # the widths mx.quantize takes


def quantize_weights(model: nn.Module, bits: int, group_size: int = 64, simulate: bool = True) -> nn.Module:
    """A copy of `model` whose Linear and Embedding weights are quantized as `nn.quantize` does.

    With `simulate` (default) each weight is replaced by its dequantized codes,
    `mx.dequantize(*mx.quantize(w, group_size, bits))`: the very values a QuantizedLinear multiplies
    with, in ordinary float matmuls (MLX's quantized matmuls are several times slower on the CPU).
    `simulate=False` calls `nn.quantize` itself (QuantizedLinear / QuantizedEmbedding modules).
    The original model is left unchanged.
    """
    if bits not in WEIGHT_BITS:
        raise ValueError(f"weight bits={bits!r} is not accepted; accepted: {', '.join(map(str, WEIGHT_BITS))}")
    out = copy.deepcopy(model)
    if not simulate:
        nn.quantize(out, group_size=group_size, bits=bits)
        return out
    for _, module in out.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.shape[-1] % group_size == 0:
            codes = mx.quantize(module.weight, group_size=group_size, bits=bits)
            module.weight = mx.dequantize(*codes, group_size=group_size, bits=bits).astype(module.weight.dtype)
    mx.eval(out.parameters())
    return out


def decode_logprobs(model: nn.Module, tokens: Sequence[int], cache: PromptCache | list, prefill_tokens: int,
                    decode: int, prefill_step: int = 2048) -> mx.array:
    """Teacher-forced log-probabilities (decode, vocab), float32, of the `decode` tokens after the prefill.

    The prefill runs without logits; each decode token then goes through the cache one at a time (where
    kvarn seals and quantization errors accumulate), as in gmlx_lab.fidelity's decode part.
    """
    if len(tokens) < prefill_tokens + decode:
        raise ValueError(f"prefill {prefill_tokens} + decode {decode} tokens needed, {len(tokens)} given")
    prefill(model, tokens[:prefill_tokens], cache, prefill_step)
    rows = []
    for p in range(prefill_tokens, prefill_tokens + decode):
        x = model(mx.array([[tokens[p]]]), cache=cache)[0, -1].astype(mx.float32)
        rows.append(x - mx.logsumexp(x))
        mx.eval(rows[-1])
    return mx.stack(rows)


FULL_WEIGHTS = "fp16"  # the model's own weights, unquantized (float32 compute on the CPU)


def weights_label(bits: int | None) -> str:
    """A weight width's name in results and figures: "fp16" for the model's own weights, else "4-bit"."""
    return FULL_WEIGHTS if bits is None else f"{bits}-bit"


def parse_weight_bits(text: str) -> list[int | None]:
    """"fp16,8,4" -> [None, 8, 4]: the weight widths a command line asks for (None: the model's own weights)."""
    out: list[int | None] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if item == FULL_WEIGHTS:
            out.append(None)
        elif item.isdigit() and int(item) in WEIGHT_BITS:
            out.append(int(item))
        else:
            raise ValueError(f"weight width {item!r} is not accepted; accepted: {FULL_WEIGHTS} or one of "
                             f"{', '.join(map(str, WEIGHT_BITS))} bits")
    return out


@dataclass
class WeightsKVResult:
    """Decode KL of every (weight width, KV scheme) pair against fp16 weights with an fp16 cache."""

    model: str
    prefill: int
    decode: int
    group_size: int
    simulate: bool
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def weights(self) -> list[str]:
        return list(dict.fromkeys(r["weights"] for r in self.rows))

    @property
    def kv(self) -> list[str]:
        return list(dict.fromkeys(r["kv"] for r in self.rows))

    def cell(self, weights: str, kv: str) -> dict[str, Any]:
        """The row of one pair, e.g. cell("4-bit", "kvarn4 tail=0")."""
        for r in self.rows:
            if r["weights"] == weights and r["kv"] == kv:
                return r
        raise KeyError((weights, kv))

    def compounding(self, weights: str, kv: str) -> float:
        """Mean KL of the pair over (weights alone + KV alone): 1.0 when the two errors just add up."""
        if weights == FULL_WEIGHTS or kv == BASELINE:
            return float("nan")  # not a pair of two quantized parts
        try:
            alone = self.cell(weights, BASELINE)["mean_kl"] + self.cell(FULL_WEIGHTS, kv)["mean_kl"]
        except KeyError:
            return float("nan")
        return self.cell(weights, kv)["mean_kl"] / alone if alone > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        rows = [{**r, "compounding": _none_if_nan(self.compounding(r["weights"], r["kv"]))} for r in self.rows]
        return {"model": self.model, "prefill": self.prefill, "decode": self.decode, "group_size": self.group_size,
                "simulate": self.simulate, "rows": rows}

    def to_markdown(self) -> str:
        """Weights as rows, KV schemes as columns: decode median KL (top-1 agreement) [compounding]."""
        rows = ["| weights \\ KV | " + " | ".join(self.kv) + " |", "|---|" + "---|" * len(self.kv)]
        for w in self.weights:
            cells = []
            for kv in self.kv:
                c, ratio = self.cell(w, kv), self.compounding(w, kv)
                both = ratio == ratio  # a pair of two quantized parts (NaN otherwise)
                cells.append(f"{c['median_kl']:.3g} ({100 * c['top1']:.0f}%)" + (f" [{ratio:.2f}x]" if both else ""))
            rows.append(f"| {w} | " + " | ".join(cells) + " |")
        return "\n".join(rows) + (
            f"\n\n{self.model}: decode median KL in nats against fp16 weights with an fp16 cache, {self.decode} "
            f"tokens after a {self.prefill}-token prefill (top-1 agreement with it) [mean KL of the pair over the "
            "sum of weights-alone and KV-alone mean KL: 1.00x when the errors just add up]")

    def _repr_markdown_(self) -> str:
        return self.to_markdown()


def weights_and_kv(
    model: nn.Module,
    tokens: Sequence[int],
    weight_bits: Sequence[int | None] = (None, 8, 4, 3),
    kv_schemes: Sequence[SchemeLike] = ("fp16", "affine4", "kvarn4:tail=0"),
    *,
    prefill: int = 1024,
    decode: int = 64,
    group_size: int = 64,
    simulate: bool = True,
    prefill_step: int = 2048,
    progress: bool = False,
) -> WeightsKVResult:
    """KL against ONE reference, fp16 weights with an fp16 cache, for every (weight width, KV scheme) pair.

    `None` in `weight_bits` is the model's own weights ("fp16"; float32 compute on the CPU). Every pair is
    measured against the same reference, so compounding shows: if the weight and KV errors just added up,
    the pair's mean KL would be the sum of weights-alone and KV-alone (`compounding` is their ratio).
    Only decode positions are scored (one token at a time through the cache), as fidelity's decode KL.
    """
    policies = [choose_policy(model, s) for s in kv_schemes]  # a quantized copy has the same cache layout
    pairs = [(b, p) for b in weight_bits for p in policies]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(pairs) + 1, desc="weights x KV", leave=False)
    reference = decode_logprobs(model, tokens, policy(model, "fp16").make_cache(), prefill, decode, prefill_step)
    ref_top = mx.argmax(reference, axis=-1)
    if bar is not None:
        bar.update(1)
    result = WeightsKVResult(model_name(model), prefill, decode, group_size, simulate)
    for bits in weight_bits:
        quantized = model if bits is None else quantize_weights(model, bits, group_size, simulate)
        for chosen in policies:
            start = time.perf_counter()
            logp = decode_logprobs(quantized, tokens, chosen.make_cache(), prefill, decode, prefill_step)
            kl = kl_from_logprobs(reference, logp)
            top1 = mx.mean((mx.argmax(logp, axis=-1) == ref_top).astype(mx.float32))
            kl_list = kl.tolist()
            result.rows.append({
                "weights": weights_label(bits), "weight_bits": bits,
                "kv": chosen.label,
                "median_kl": float(np.median(kl_list)), "mean_kl": float(np.mean(kl_list)),
                "p99_kl": float(np.percentile(kl_list, 99)), "top1": top1.item(),
                "seconds": round(time.perf_counter() - start, 2), "decode_kl": kl_list})
            if bar is not None:
                bar.update(1)
        del quantized
    if bar is not None:
        bar.close()
    return result
