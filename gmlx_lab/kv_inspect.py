"""Look inside a real model run: its K/V per layer and head, its attention weights, its generations.

    cap = capture(model, ids)               # run ids through fp16 caches, keep K/V (+ attention)
    cap.k(layer=3, head=0)                  # (tokens, head_dim) post-RoPE keys, float32 numpy
    cap.sink_mass()                         # (layers, query heads) attention share on the first 128 tokens
    gen = generate(model, tokenizer, "Once upon a time", "affine", bits=4)

Everything runs through `gmlx_lab.make_cache`, so it sees exactly what the caches
store. The K read back from an fp16 cache is post-RoPE (the cache gets K after
the model applied its rotary embedding). Attention weights come from a cache
subclass whose `attend` also keeps the softmax (the hook in `cache/attention.py`
routes each layer's attention to it); keep contexts short (a few hundred tokens),
since the weights are tokens x tokens per head.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .cache.attention import grouped_output, grouped_scores
from .cache.fp16 import FP16Cache
from .policy import make_cache, model_name
from .registry import BASELINE

EVAL_TEXT = Path(__file__).resolve().parent / "data" / "eval_text.txt"

__all__ = [
    "Capture", "Generation", "capture", "eval_tokens", "first_divergence", "generate",
    "greedy",
]


class _RecordingFP16Cache(FP16Cache):
    """An fp16 cache whose attention also keeps its softmax weights (B, Hq, L, T)."""

    probs: list[mx.array]

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
        probs = mx.softmax(grouped_scores(queries, keys, scale, mask), axis=-1)
        self.probs.append(probs.reshape(queries.shape[0], queries.shape[1], queries.shape[2], -1))
        return grouped_output(probs, values)


def eval_tokens(tokenizer: Any, n: int = 256, start: int = 0, bos: bool = True) -> list[int]:
    """`n` token ids of the bundled evaluation text (from character `start`), with BOS first if it has one."""
    text = EVAL_TEXT.read_text(encoding="utf-8")[start : start + n * 12]
    ids = list(tokenizer.encode(text, add_special_tokens=False) if hasattr(tokenizer, "encode") else text)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos and bos_id is not None:
        ids = [bos_id, *ids]
    if len(ids) < n:
        raise ValueError(f"eval text gave only {len(ids)} tokens, {n} asked")
    return ids[:n]


@dataclass
class Capture:
    """K/V (and optionally attention weights) of one run, per attention layer, as float32 numpy."""

    model: str
    tokens: list[int]
    keys: dict[int, np.ndarray]  # layer -> (kv_heads, tokens, head_dim)
    values: dict[int, np.ndarray]
    probs: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> (q_heads, tokens, tokens)

    @property
    def layers(self) -> list[int]:
        return sorted(self.keys)

    def k(self, layer: int, head: int = 0) -> np.ndarray:
        """Post-RoPE keys of one KV head: (tokens, head_dim)."""
        return self.keys[layer][head]

    def v(self, layer: int, head: int = 0) -> np.ndarray:
        """Values of one KV head: (tokens, head_dim)."""
        return self.values[layer][head]

    def sink_mass(self, sink: int = 128, after: int | None = None) -> np.ndarray:
        """(layers, q_heads): mean share of attention that queries at positions >= `after` put on tokens < `sink`."""
        if not self.probs:
            raise ValueError("this capture has no attention weights; call capture(..., attention=True)")
        after = sink if after is None else after
        rows = []
        for layer in self.layers:
            p = self.probs[layer][:, after:, :sink]
            rows.append(p.sum(-1).mean(-1) if p.shape[1] else np.zeros(p.shape[0]))
        return np.stack(rows)

    def _repr_html_(self) -> str:
        kv = self.keys[self.layers[0]]
        return (f"<b>Capture</b> of <code>{html.escape(self.model)}</code>: {len(self.tokens)} tokens, "
                f"{len(self.layers)} attention layers, {kv.shape[0]} KV head(s) of dim {kv.shape[2]}"
                f"{', with attention weights' if self.probs else ''}")


def capture(model: Any, tokens: list[int] | mx.array, attention: bool = False) -> Capture:
    """Run `tokens` through the model with fp16 caches and read back every layer's K/V (and softmax)."""
    ids = mx.array(tokens).reshape(1, -1)
    cache = make_cache(model, BASELINE, quiet=True)
    for c in cache:
        if type(c) is FP16Cache:
            c.__class__ = _RecordingFP16Cache
            c.probs = []
    model(ids, cache=cache)  # a lazy graph: only what is evaluated below is computed
    recorded = [c for c in cache if isinstance(c, _RecordingFP16Cache) and c.offset]
    # The caches' K/V (and softmax), not the logits: tokens x vocabulary floats that nothing here reads
    # (268 MB for Gemma 3's 262144-token vocabulary at 256 tokens).
    mx.eval([x for c in recorded for x in (c.keys.view(c.offset), c.values.view(c.offset))],
            [c.probs[-1] for c in recorded if attention and c.probs])
    keys, values, probs = {}, {}, {}
    for i, c in enumerate(cache):
        if c in recorded:
            keys[i] = np.array(c.keys.view(c.offset)[0].astype(mx.float32))
            values[i] = np.array(c.values.view(c.offset)[0].astype(mx.float32))
            if attention and c.probs:
                probs[i] = np.array(c.probs[-1][0])
    return Capture(model_name(model), [int(t) for t in ids[0].tolist()], keys, values, probs)


@dataclass
class Generation:
    """A greedy generation under one scheme, with its speed and final cache size."""

    label: str
    prompt_tokens: int
    tokens: list[int]
    pieces: list[str]
    prefill_seconds: float
    tokens_per_s: float  # decode speed, after the first token
    cache_bytes: int

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def _repr_html_(self) -> str:
        return (f"<b>{html.escape(self.label)}</b>: {html.escape(self.text)}<br><small>{len(self.tokens)} tokens, "
                f"{self.tokens_per_s:.1f} tok/s, cache {self.cache_bytes / 1024:.1f} KiB</small>")


def greedy(model: Any, prompt: list[int], cache: Any, max_tokens: int,
           eos: set[int] | frozenset[int] = frozenset()) -> tuple[list[int], float, float]:
    """Greedy tokens through mlx-lm's own `generate_step`: (tokens, prefill seconds, decode tokens/s)."""
    from mlx_lm.generate import generate_step

    out: list[int] = []
    start = first = time.perf_counter()
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache):
        out.append(int(token))
        if len(out) == 1:
            first = time.perf_counter()
        if out[-1] in eos:
            break
    end = time.perf_counter()
    rate = (len(out) - 1) / (end - first) if len(out) > 1 and end > first else float("nan")
    return out, first - start, rate


def generate(model: Any, tokenizer: Any, prompt: str | list[int], scheme: str = BASELINE, max_tokens: int = 24,
             **options: Any) -> Generation:
    """Greedy decoding of `max_tokens` after `prompt` with the scheme's cache."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    cache = make_cache(model, scheme, quiet=True, **options)
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    out, prefill_s, rate = greedy(model, ids, cache, max_tokens, eos)
    pieces = [tokenizer.decode([t]) for t in out]
    return Generation(cache.policy.label, len(ids), out, pieces, prefill_s, rate, cache.nbytes)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ (None if one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None
