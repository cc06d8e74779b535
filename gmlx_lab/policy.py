"""The per-layer policy: which layers of a model a scheme quantizes, and why.

The decision reads the shape of each layer's cache, never the model's name: the
model builds its own mlx-lm cache list and runs one token through it, and each
entry is then classed as growing attention, latent (MLA) attention, sliding
window or recurrent state. Rules (gmlx's, see docs/kvarn-spec.md section 4):
growing attention quantizes; in a stack of more than 2 entries the last entry
stays fp16; recurrent and sliding-window layers stay fp16. Each scheme adds its own
rule (`Scheme.declines`: kvarn needs head dims 128/256/512 and declines latent caches,
affine needs head dims that split into its groups). A model on which a scheme can use
no layer runs fp16 and the summary says why; nothing falls back to another scheme.

One knowing difference from gmlx: gmlx keeps Kimi K2 fp16 under affine as well,
but Kimi K2's cache has exactly DeepSeek-V3's latent shape, so a shape-only
policy packs it with affine like DeepSeek-V3.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from .cache import GmlxCache
from .registry import BASELINE, Scheme, get_scheme


@dataclass
class LayerDecision:
    """One cache entry: what it is, what the scheme does with it, and why."""

    index: int
    kind: str  # "attention", "latent-attention", "sliding-window", "recurrent" or "other"
    decision: str  # a registered scheme's name: the policy's scheme, or "fp16"
    reason: str
    cache_class: str
    kv_heads: int | None = None
    k_head_dim: int | None = None
    v_head_dim: int | None = None

    @property
    def grows(self) -> bool:
        """True for attention whose cache grows with the context."""
        return self.kind in ("attention", "latent-attention")


def probe_layers(model: nn.Module) -> list[tuple[Any, str, tuple[int, ...] | None, tuple[int, ...] | None]]:
    """Run one token through the model's own caches and read each entry's class and K/V shape."""
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=caches))
    found = []
    for c in caches:
        if isinstance(c, ArraysCache):
            found.append((c, "recurrent", None, None))
        elif isinstance(c, RotatingKVCache):
            found.append((c, "sliding-window", c.keys.shape, c.values.shape))
        elif isinstance(c, KVCache):
            kind = "attention" if c.keys.shape[-1] == c.values.shape[-1] else "latent-attention"
            found.append((c, kind, c.keys.shape, c.values.shape))
        else:
            found.append((c, "other", None, None))
    return found


def _decide(index: int, n: int, kind: str, kdim: int | None, vdim: int | None,
            scheme: Scheme, options: dict[str, Any]) -> tuple[str, str]:
    """The shared rules first, then the scheme's own (`Scheme.declines`)."""
    if kind == "recurrent":
        return BASELINE, "recurrent state"
    if kind == "sliding-window":
        return BASELINE, "sliding window"
    if kind == "other":
        return BASELINE, "not a growing attention cache"
    if n > 2 and index == n - 1:
        return BASELINE, "last of deep stack"
    reason = scheme.declines(kind, kdim, vdim, options)
    if reason is not None:
        return BASELINE, reason
    return scheme.name, "growing attention"


def _group(indices: list[int]) -> str:
    return ("layer " if len(indices) == 1 else "layers ") + ",".join(map(str, indices))


class Policy:
    """A scheme applied to one model, layer by layer: `str()` is the [kv] line, `as_dict()` the report."""

    def __init__(self, model: nn.Module, name: str, scheme: str, options: dict[str, Any],
                 layers: list[LayerDecision]):
        self.model, self.name, self.scheme, self.options, self.layers = model, name, scheme, options, layers

    @property
    def label(self) -> str:
        return get_scheme(self.scheme).label(self.options)

    @property
    def quantized(self) -> list[LayerDecision]:
        return [d for d in self.layers if d.decision != BASELINE]

    def __str__(self) -> str:
        growing = [d for d in self.layers if d.grows]
        reasons: dict[str, list[int]] = {}
        for d in self.layers:
            if d.decision == BASELINE and (d.grows or self.scheme == BASELINE):
                reasons.setdefault(d.reason, []).append(d.index)
        others: dict[str, int] = {}
        for d in self.layers:
            if not d.grows:
                others[d.kind] = others.get(d.kind, 0) + 1
        extra = "".join(f", {n} {kind} fp16" for kind, n in others.items())
        why = "; ".join(f"{_group(ix)} fp16: {r}" for r, ix in reasons.items() if r != "fp16 scheme")
        if self.scheme == BASELINE:
            return f"[kv] {self.name}: {BASELINE} -> {len(growing)} attn layers {BASELINE}{extra}"
        if not self.quantized:
            why = why or "no growing attention layer"
            return f"[kv] {self.name}: {self.label} -> no layer can use {self.scheme} ({why}) -> running {BASELINE}"
        detail = f" ({why})" if why else ""
        done = f"{len(self.quantized)}/{len(growing)}"
        return f"[kv] {self.name}: {self.label} -> quantized {done} attn layers{detail}{extra}"

    def as_dict(self) -> dict[str, Any]:
        """The `kv_quant` report: scheme, widths, options, the summary and every layer's decision."""
        bits = get_scheme(self.scheme).bits(self.options)
        return {
            "model": self.name,
            "scheme": self.scheme,
            "bits": bits,
            "options": dict(self.options),
            "summary": str(self),
            "quantized_layers": len(self.quantized),
            "attention_layers": sum(d.grows for d in self.layers),
            "layers": [asdict(d) for d in self.layers],
        }

    def make_cache(self) -> PromptCache:
        """Fresh caches, one per entry: ours where the policy decided, the model's own elsewhere."""
        out = PromptCache(policy=self)
        for d, native in zip(self.layers, make_prompt_cache(self.model)):
            if d.decision != BASELINE:
                out.append(get_scheme(d.decision).make_cache(self.options, layer=d.index))
            elif d.kind == "attention":
                out.append(get_scheme(BASELINE).make_cache({}, layer=d.index))
            else:
                out.append(native)
        return out


class PromptCache(list):
    """The list to pass as `prompt_cache` (or `cache=`), carrying the policy that built it."""

    def __init__(self, items: Any = (), policy: Policy | None = None):
        super().__init__(items)
        self.policy = policy

    @property
    def nbytes(self) -> int:
        """Resident bytes of every entry."""
        return sum(c.nbytes for c in self)

    def seal(self) -> int:
        """Seal what each sealing layer (kvarn, block schemes) has due now; returns the records or blocks sealed."""
        return sum(c.seal() for c in self if hasattr(c, "seal"))

    def regions(self) -> list[dict[str, int]]:
        """Per-layer resident bytes by region (our caches), or one "native" entry for the model's own caches."""
        return [c.regions() if isinstance(c, GmlxCache) else {"native": c.nbytes} for c in self]


def model_name(model: nn.Module) -> str:
    """A display name: `gmlx_name` set by gmlx_lab.load, else the config's model_type."""
    name = getattr(model, "gmlx_name", None) or getattr(model, "model_type", None)
    if name is None and hasattr(model, "args"):
        name = getattr(model.args, "model_type", None)
    return str(name or type(model).__module__.rsplit(".", 1)[-1])


def policy(model: nn.Module, scheme: str = "kvarn", *, name: str | None = None, **options: Any) -> Policy:
    """Decide, for each of the model's cache entries, how `scheme` stores it and why."""
    spec = get_scheme(scheme)
    values = spec.resolve(**options)
    probed = probe_layers(model)
    layers = []
    for i, (cache, kind, kshape, vshape) in enumerate(probed):
        kdim = kshape[-1] if kshape else None
        vdim = vshape[-1] if vshape else None
        decision, reason = _decide(i, len(probed), kind, kdim, vdim, spec, values)
        layers.append(LayerDecision(i, kind, decision, reason, type(cache).__name__,
                                    kshape[1] if kshape else None, kdim, vdim))
    return Policy(model, name or model_name(model), scheme, values, layers)


def make_cache(model: nn.Module, scheme: str = "kvarn", *, quiet: bool = False, name: str | None = None,
               **options: Any) -> PromptCache:
    """Apply the policy and return the caches to pass as `prompt_cache`; prints the [kv] line unless quiet."""
    chosen = policy(model, scheme, name=name, **options)
    if not quiet:
        print(chosen, file=sys.stdout)
    return chosen.make_cache()
