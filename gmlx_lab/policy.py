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

import copy
import sys
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from . import window
from .cache import GmlxCache
from .kernels import selfcheck
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
    """The shared rules first, then the scheme's own (`Scheme.declines`, `Scheme.reason_taken`)."""
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
    return scheme.name, scheme.reason_taken(kind, kdim, vdim, options)


def _group(indices: list[int]) -> str:
    return ("layer " if len(indices) == 1 else "layers ") + ",".join(map(str, indices))


class Policy:
    """A scheme applied to one model, layer by layer: `str()` is the [kv] line, `as_dict()` the report."""

    def __init__(self, model: nn.Module, name: str, scheme: str, options: dict[str, Any],
                 layers: list[LayerDecision], max_kv_size: int | None = None):
        self.model, self.name, self.scheme, self.options, self.layers = model, name, scheme, options, layers
        self.max_kv_size = max_kv_size  # the rolling window of the growing attention layers (window.py)
        self.fallbacks: dict[str, str] = {}  # kernels that failed their self-check, set by make_cache

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
            return f"[kv] {self.name}: {BASELINE} -> {len(growing)} attn layers {BASELINE}{extra}{self._notes()}"
        if not self.quantized:
            why = why or "no growing attention layer"
            note = self._notes()
            return (f"[kv] {self.name}: {self.label} -> no layer can use {self.scheme} ({why}) -> running "
                    f"{BASELINE}{note}")
        detail = f" ({why})" if why else ""
        done = f"{len(self.quantized)}/{len(growing)}"
        return f"[kv] {self.name}: {self.label} -> quantized {done} attn layers{detail}{extra}{self._notes()}"

    def _notes(self) -> str:
        """What the [kv] line adds: the rolling window, and kernels that failed their self-check."""
        notes = [f"{k} failed its self-check ({why}) -> reference path" for k, why in self.fallbacks.items()]
        ext = [d.index for d in self.quantized if "extension" in d.reason]
        if ext:
            notes.insert(0, f"{_group(ext)} by the head-dim extension: records outside gmlx's format")
        if self.max_kv_size is not None:
            how = "quantized" if self.quantized else BASELINE
            notes.insert(0, f"rolling window of {self.max_kv_size} tokens ({how}: 128-token sink kept, oldest groups "
                            "of 128 leave)")
        return "".join(f"; {n}" for n in notes)

    def as_dict(self) -> dict[str, Any]:
        """The `kv_quant` report: scheme, widths, options, the summary and every layer's decision."""
        bits = get_scheme(self.scheme).bits(self.options)
        return {
            "model": self.name,
            "scheme": self.scheme,
            "bits": bits,
            "options": dict(self.options),
            "summary": str(self),
            "max_kv_size": self.max_kv_size,
            "kernel_fallbacks": dict(self.fallbacks),
            "quantized_layers": len(self.quantized),
            "attention_layers": sum(d.grows for d in self.layers),
            "layers": [asdict(d) for d in self.layers],
        }

    def windowed(self, max_kv_size: int | None) -> Policy:
        """The same decisions with a rolling window of `max_kv_size` tokens on the growing attention layers."""
        chosen = Policy(self.model, self.name, self.scheme, self.options, self.layers, max_kv_size)
        if max_kv_size is not None:  # the quantized layers roll as their scheme says, fp16 ones by the shared rule
            where = f"{self.name}: {self.label}"
            if self.quantized:
                get_scheme(self.scheme).check_window(max_kv_size, self.options, where)
            else:
                window.check(max_kv_size, None, where)
        return chosen

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
            if self.max_kv_size is not None and d.grows and isinstance(out[-1], GmlxCache):
                out[-1].set_window(self.max_kv_size)
        # on a GPU, each kernel these caches use is self-checked once per process before its first use
        for c in out:
            for k in getattr(c, "KERNELS", ()):
                if c.attention_path != "reference" and not selfcheck.passed(k):
                    self.fallbacks[k] = selfcheck.failure(k) or ""
        return out


class PromptCache(list):
    """The list to pass as `prompt_cache` (or `cache=`), carrying the policy that built it."""

    def __init__(self, items: Any = (), policy: Policy | None = None):
        super().__init__(items)
        self.policy = policy

    def __deepcopy__(self, memo: dict) -> PromptCache:
        """Independent copies of the entries (mlx-lm's BatchGenerator and evaluate deep-copy prompt caches);
        the policy, a description of how they were built (with the model), is shared, not copied."""
        return PromptCache((copy.deepcopy(c, memo) for c in self), policy=self.policy)

    @property
    def nbytes(self) -> int:
        """Resident bytes of every entry."""
        return sum(c.nbytes for c in self)

    def settle(self) -> None:
        """Every layer does now what its next update would do first: kvarn seals its due records, rolling
        windows drop what they no longer hold (GmlxCache.settle). For reports of the steady-state bytes."""
        for c in self:
            if isinstance(c, GmlxCache):
                c.settle()

    def regions(self) -> list[dict[str, int]]:
        """Per-layer resident bytes by region (our caches), or one "native" entry for the model's own caches."""
        return [c.regions() if isinstance(c, GmlxCache) else {"native": c.nbytes} for c in self]


def model_name(model: nn.Module) -> str:
    """A display name: `gmlx_name` set by gmlx_lab.load, else the config's model_type."""
    name = getattr(model, "gmlx_name", None) or getattr(model, "model_type", None)
    if name is None and hasattr(model, "args"):
        name = getattr(model.args, "model_type", None)
    return str(name or type(model).__module__.rsplit(".", 1)[-1])


def policy(model: nn.Module, scheme: str = "kvarn", *, name: str | None = None, max_kv_size: int | None = None,
           **options: Any) -> Policy:
    """Decide, for each of the model's cache entries, how `scheme` stores it and why.

    `max_kv_size`: make the growing attention layers rolling windows of that many tokens (gmlx's --max-kv-size),
    quantized under the scheme; a window a layer cannot roll (kvarn: smaller than sink + tail + two groups) is
    refused here."""
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
    return Policy(model, name or model_name(model), scheme, values, layers).windowed(max_kv_size)


def make_cache(model: nn.Module, scheme: str = "kvarn", *, quiet: bool = False, name: str | None = None,
               max_kv_size: int | None = None, **options: Any) -> PromptCache:
    """Apply the policy and return the caches to pass as `prompt_cache`; prints the [kv] line unless quiet.

    `max_kv_size`: rolling windows of that many tokens for the growing attention layers (see `policy`)."""
    chosen = policy(model, scheme, name=name, max_kv_size=max_kv_size, **options)
    cache = chosen.make_cache()  # first: the [kv] line then says if a kernel failed its self-check
    if not quiet:
        print(chosen, file=sys.stdout)
    return cache
