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

Overrides, for exploration (`Overrides`; the default is gmlx's rule): `layers` quantizes only the listed
layers, `fp16_layers` keeps the listed ones fp16, `quantize_last` quantizes the last of a deep stack, and
`quantize_sliding` the sliding-window layers. A quantized sliding layer holds a rolling window of the
scheme's cache (gmlx_lab/cache/window.py: the 128-token sink and whole groups of 128; `sliding_hold` tokens, at
least the model's window plus two groups) and hands the model what mlx-lm's RotatingKVCache would: the
newest window - 1 tokens before each update, then the update, with RotatingKVCache's masks
(`GmlxCache.set_sliding`). So the model's own sliding mask, which mlx-lm builds once from the first
sliding layer's cache and gives to every sliding layer, fits each of them, quantized or not; the sink the
rolling window keeps is held but never attended. Every override is named in the [kv] line and, per layer
with its reason, in `as_dict()`.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from .cache import GmlxCache, window
from .kernels import precompiled, selfcheck
from .plans import Plan, load_plan, widths_label
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
    window: int | None = None  # a sliding-window layer's window: the tokens each query sees
    options: dict[str, Any] = field(default_factory=dict)  # this layer's own widths (a plan), over the policy's

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


OVERRIDE = "override: "  # the start of every reason an override gave


@dataclass(frozen=True)
class Overrides:
    """Exploration beyond gmlx's rule (the default, all unset): which layers to quantize anyway or keep fp16.

    layers: quantize only these (rule-kept ones too: the last of the stack, sliding windows); fp16_layers:
    keep these fp16; quantize_last: also the last of a deep stack; quantize_sliding: also every sliding-window
    layer. A layer the scheme itself cannot take (head dim, latent cache) stays fp16 with the scheme's reason.
    """

    layers: tuple[int, ...] | None = None
    fp16_layers: tuple[int, ...] = ()
    quantize_last: bool = False
    quantize_sliding: bool = False

    def __bool__(self) -> bool:
        return self.layers is not None or bool(self.fp16_layers) or self.quantize_last or self.quantize_sliding

    def suffix(self) -> str:
        """What the label adds, e.g. " +layers 5,11 +last +sliding -fp16 3"."""
        parts = [f"+layers {','.join(map(str, self.layers))}"] if self.layers is not None else []
        parts += ["+last"] * self.quantize_last + ["+sliding"] * self.quantize_sliding
        parts += [f"-fp16 {','.join(map(str, self.fp16_layers))}"] if self.fp16_layers else []
        return "".join(" " + p for p in parts)

    def as_dict(self) -> dict[str, Any]:
        return {"layers": None if self.layers is None else list(self.layers), "fp16_layers": list(self.fp16_layers),
                "quantize_last": self.quantize_last, "quantize_sliding": self.quantize_sliding}


def check_overrides(layers: Any, fp16_layers: Any, quantize_last: Any, quantize_sliding: Any,
                    kinds: list[str], where: str) -> Overrides:
    """Overrides from the arguments of `policy`, or a ValueError naming what was wrong and what is accepted."""
    n = len(kinds)

    def indices(value: Any, arg: str) -> tuple[int, ...]:
        items = [value] if isinstance(value, int) else value
        try:
            items = list(items)
        except TypeError:
            raise ValueError(f"{where}: {arg}={value!r}; accepted: a list of layer indices 0..{n - 1}") from None
        for i in items:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                raise ValueError(f"{where}: {arg} has {i!r}; accepted: layer indices 0..{n - 1} (the model has "
                                 f"{n} cache entries)")
        return tuple(sorted(set(items)))

    for arg, flag in (("quantize_last", quantize_last), ("quantize_sliding", quantize_sliding)):
        if not isinstance(flag, bool):
            raise ValueError(f"{where}: {arg}={flag!r}; accepted: True or False")
    chosen = None if layers is None else indices(layers, "layers")
    kept = () if fp16_layers is None else indices(fp16_layers, "fp16_layers")
    if chosen is not None:
        if not chosen:
            raise ValueError(f"{where}: layers=[] quantizes nothing; use the fp16 scheme, or list layers 0..{n - 1}")
        both = sorted(set(chosen) & set(kept))
        if both:
            raise ValueError(f"{where}: layers {both} are both in layers (quantize) and fp16_layers (keep fp16)")
        for i in chosen:
            if kinds[i] in ("recurrent", "other"):
                takes = [j for j, k in enumerate(kinds) if k not in ("recurrent", "other")]
                raise ValueError(f"{where}: layer {i} is {kinds[i]} state, no K/V cache to quantize; accepted: "
                                 f"the attention layers {','.join(map(str, takes))}")
    return Overrides(chosen, kept, quantize_last, quantize_sliding)


def _override(d: LayerDecision, native: Any, scheme: Scheme, options: dict[str, Any], ov: Overrides) -> None:
    """Apply the overrides to one layer's rule decision `d` (in place)."""
    if d.index in ov.fp16_layers:
        d.decision, d.reason = BASELINE, OVERRIDE + "kept fp16 by request (fp16_layers)"
        return
    if ov.layers is not None and d.index in ov.layers:
        ask = f"quantized by request (layers={list(ov.layers)})"
    elif ov.quantize_last and d.reason == "last of deep stack":
        ask = "last of deep stack, quantized by request"
    elif ov.quantize_sliding and d.kind == "sliding-window":
        ask = "sliding window, quantized by request"
    else:
        if ov.layers is not None and d.decision != BASELINE:
            d.decision, d.reason = BASELINE, OVERRIDE + f"fp16, not in layers={list(ov.layers)}"
        return
    declined = scheme.declines(d.kind, d.k_head_dim, d.v_head_dim, options)
    how = ""
    if declined is None and d.kind == "sliding-window":
        declined, how = _sliding_check(d, native, scheme, options)
    if declined is not None:
        d.decision, d.reason = BASELINE, f"{declined} ({OVERRIDE}{ask}: {scheme.name} declines)"
        return
    taken = scheme.reason_taken(d.kind, d.k_head_dim, d.v_head_dim, options)
    extra = "" if taken == "growing attention" else f"; {taken.removeprefix('growing attention, ')}"
    d.decision, d.reason = scheme.name, OVERRIDE + ask + how + extra


def _sliding_check(d: LayerDecision, native: Any, scheme: Scheme, options: dict[str, Any]) -> tuple[str | None, str]:
    """(why the scheme cannot serve this sliding layer or None, how it serves it) -- see the module docstring."""
    if getattr(native, "keep", 0):
        return f"RotatingKVCache keep={native.keep}: only windows without kept tokens are served", ""
    hold = window.sliding_hold(d.window, options.get("kv_tail_tokens"))
    try:
        scheme.check_window(hold, options, f"layer {d.index}")
    except ValueError as err:
        return f"no rolling window for a sliding layer: {err}", ""
    return None, (f" (the model's {d.window}-token sliding mask; a rolling window of up to {hold} tokens, its "
                  "128-token sink held, not attended)")


def _group(indices: list[int]) -> str:
    return ("layer " if len(indices) == 1 else "layers ") + ",".join(map(str, indices))


class Policy:
    """A scheme applied to one model, layer by layer: `str()` is the [kv] line, `as_dict()` the report."""

    def __init__(self, model: nn.Module, name: str, scheme: str, options: dict[str, Any],
                 layers: list[LayerDecision], max_kv_size: int | None = None, overrides: Overrides | None = None,
                 environment: str = "", plan: Plan | None = None):
        self.model, self.name, self.scheme, self.options, self.layers = model, name, scheme, options, layers
        self.plan = plan  # per-layer widths (plans.py), set in `layers[i].options`
        self.max_kv_size = max_kv_size  # the rolling window of the growing attention layers (window.py)
        self.overrides = overrides or Overrides()  # exploration beyond gmlx's rule (default: none)
        self.environment = environment  # what the environment chose (Scheme.environment), '' for nothing
        self.fallbacks: dict[str, str] = {}  # kernels that failed their self-check, set by make_cache

    @property
    def label(self) -> str:
        """The scheme's label, with the overrides (e.g. `kvarn4 tail=128 +last +sliding`), or the plan's."""
        if self.plan is not None:
            return self.plan.label
        return get_scheme(self.scheme).label(self.options) + self.overrides.suffix()

    def layer_options(self, index: int) -> dict[str, Any]:
        """The options layer `index` is stored with: the policy's, with the layer's own widths (a plan) over them."""
        return {**self.options, **self.layers[index].options}

    @property
    def quantized(self) -> list[LayerDecision]:
        return [d for d in self.layers if d.decision != BASELINE]

    def __str__(self) -> str:
        growing = [d for d in self.layers if d.grows]
        reasons: dict[str, list[int]] = {}
        for d in self.layers:
            if d.decision == BASELINE and (d.grows or self.scheme == BASELINE):
                reasons.setdefault(d.reason, []).append(d.index)
        others: dict[str, list[int]] = {}  # kind -> [entries, quantized]
        for d in self.layers:
            if not d.grows:
                count = others.setdefault(d.kind, [0, 0])
                count[0] += 1
                count[1] += d.decision != BASELINE
        extra = "".join(f", {n} {kind} fp16" if not q else f", {q}/{n} {kind} quantized"
                        for kind, (n, q) in others.items())
        why = "; ".join(f"{_group(ix)} fp16: {r}" for r, ix in reasons.items() if r != "fp16 scheme")
        if self.scheme == BASELINE:
            return f"[kv] {self.name}: {BASELINE} -> {len(growing)} attn layers {BASELINE}{extra}{self._notes()}"
        if not self.quantized:
            why = why or "no growing attention layer"
            note = self._notes()
            return (f"[kv] {self.name}: {self.label} -> no layer can use {self.scheme} ({why}) -> running "
                    f"{BASELINE}{note}")
        detail = f" ({why})" if why else ""
        done = f"{sum(d.decision != BASELINE for d in growing)}/{len(growing)}"
        return f"[kv] {self.name}: {self.label} -> quantized {done} attn layers{detail}{extra}{self._notes()}"

    def _notes(self) -> str:
        """What the [kv] line adds: what the environment chose (scheme widths),
        the rolling window, the overrides, kernels that failed their self-check, and kernels compiled in each
        process for want of the disk cache (kernels/precompiled.py)."""
        notes = [f"{k} failed its self-check ({why}) -> reference path" for k, why in self.fallbacks.items()]
        if self.quantized and precompiled.note():
            notes.append(precompiled.note())
        cls = get_scheme(self.scheme).cache_class
        path = cls.decode_path(self.options) if isinstance(cls, type) and issubclass(cls, GmlxCache) else ""
        if self.quantized and path:
            notes.append(f"{self.scheme}: {path}")  # no fused GPU kernel here: say so (GmlxCache.decode_path)
        said: dict[str, list[int]] = {}  # overrides not among the fp16 reasons already (quantized, not attention)
        for d in self.layers:
            if OVERRIDE in d.reason and not (d.grows and d.decision == BASELINE):
                said.setdefault(d.reason, []).append(d.index)
        for reason, ix in reversed(said.items()):
            notes.insert(0, f"{_group(ix)} {reason}")
        ext = [d.index for d in self.quantized if "extension" in d.reason]
        if ext:
            notes.insert(0, f"{_group(ext)} by the head-dim extension: records outside gmlx's format")
        if self.max_kv_size is not None:
            how = "quantized" if self.quantized else BASELINE
            notes.insert(0, f"rolling window of {self.max_kv_size} tokens ({how}: 128-token sink kept, oldest groups "
                            "of 128 leave)")
        if self.environment:
            notes.insert(0, self.environment)
        if self.plan is not None:
            widths = {}  # widths label -> layers
            for d in self.layers:
                if d.index in self.plan.widths:
                    widths.setdefault(widths_label(self.plan.widths[d.index]), []).append(d.index)
            notes.insert(0, "widths by the plan: " + ", ".join(f"{_group(ix)} {w}" for w, ix in widths.items()))
        return "".join(f"; {n}" for n in notes)

    def as_dict(self) -> dict[str, Any]:
        """The `kv_quant` report: scheme, widths, options, the summary and every layer's decision."""
        bits = None if self.plan is not None else get_scheme(self.scheme).bits(self.options)  # a plan: per layer
        return {
            "model": self.name,
            "scheme": self.scheme,
            "bits": bits,
            "options": dict(self.options),
            "environment": self.environment,
            "summary": str(self),
            "max_kv_size": self.max_kv_size,
            "kernel_fallbacks": dict(self.fallbacks),
            "quantized_layers": len(self.quantized),
            "attention_layers": sum(d.grows for d in self.layers),
            "quantized_sliding_layers": sum(d.kind == "sliding-window" for d in self.quantized),
            "overrides": self.overrides.as_dict(),
            "plan": None if self.plan is None else self.plan.to_dict(),
            "layers": [asdict(d) for d in self.layers],
        }

    def windowed(self, max_kv_size: int | None) -> Policy:
        """The same decisions with a rolling window of `max_kv_size` tokens on the growing attention layers."""
        chosen = Policy(self.model, self.name, self.scheme, self.options, self.layers, max_kv_size, self.overrides,
                        self.environment, self.plan)
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
                out.append(get_scheme(d.decision).make_cache(self.layer_options(d.index), layer=d.index))
                if d.kind == "sliding-window":  # serves the model's window (see the module docstring)
                    out[-1].set_window(window.sliding_hold(d.window, self.options.get("kv_tail_tokens")))
                    out[-1].set_sliding(d.window)
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


def policy(model: nn.Module, scheme: str | None = None, *, name: str | None = None,
           max_kv_size: int | None = None, layers: list[int] | None = None, fp16_layers: list[int] | None = None,
           quantize_last: bool = False, quantize_sliding: bool = False, plan: Plan | dict | str | None = None,
           **options: Any) -> Policy:
    """Decide, for each of the model's cache entries, how `scheme` (default kvarn) stores it and why.

    `max_kv_size`: make the growing attention layers rolling windows of that many tokens (gmlx's --max-kv-size),
    quantized under the scheme; a window a layer cannot roll (kvarn: smaller than sink + tail + two groups) is
    refused here. `layers`, `fp16_layers`, `quantize_last`, `quantize_sliding`: overrides of gmlx's rule for
    exploration (see `Overrides` and the module docstring); bad indices raise a ValueError naming the range.
    `plan`: per-layer widths (a `Plan`, its dict or its JSON file: `gmlx_lab.plan`), which bring their scheme,
    options and overrides; only `name` and `max_kv_size` go with it."""
    if plan is not None:
        return planned_policy(model, load_plan(plan), scheme, name, max_kv_size, layers, fp16_layers,
                              quantize_last, quantize_sliding, options)
    scheme = scheme or "kvarn"
    spec = get_scheme(scheme)
    values = spec.resolve(**options)
    probed = probe_layers(model)
    display = name or model_name(model)
    ov = check_overrides(layers, fp16_layers, quantize_last, quantize_sliding, [p[1] for p in probed], display)
    if scheme == BASELINE:
        ov = Overrides()  # the baseline quantizes nothing: overrides do not apply to it
    decided = []
    for i, (cache, kind, kshape, vshape) in enumerate(probed):
        kdim = kshape[-1] if kshape else None
        vdim = vshape[-1] if vshape else None
        decision, reason = _decide(i, len(probed), kind, kdim, vdim, spec, values)
        d = LayerDecision(i, kind, decision, reason, type(cache).__name__, kshape[1] if kshape else None, kdim, vdim,
                          cache.max_size if kind == "sliding-window" else None)
        if ov:
            _override(d, cache, spec, values, ov)
        decided.append(d)
    chosen = Policy(model, display, scheme, values, decided, overrides=ov, environment=spec.environment(options))
    return chosen.windowed(max_kv_size)


def planned_policy(model: nn.Module, plan: Plan, scheme: str | None, name: str | None, max_kv_size: int | None,
                   layers: Any, fp16_layers: Any, quantize_last: bool, quantize_sliding: bool,
                   options: dict[str, Any]) -> Policy:
    """The policy of `plan` on `model`: its scheme's rule under its overrides, then its widths layer by layer.

    Refused with a ValueError: another scheme, options or overrides beside the plan, and a plan that does not fit
    the model (a layer it quantizes that the rule keeps fp16, a quantized layer it has no widths for)."""
    where = f"plan {plan.label} for {plan.model}"
    if scheme is not None and scheme != plan.scheme:
        raise ValueError(f"{where}: the plan is for {plan.scheme}, not {scheme}; drop the scheme or the plan")
    given = [k for k, v in (("layers", layers), ("fp16_layers", fp16_layers), ("quantize_last", quantize_last),
                            ("quantize_sliding", quantize_sliding)) if v] + sorted(options)
    if given:
        raise ValueError(f"{where}: {', '.join(given)} cannot go with a plan (it sets its own options, overrides "
                         "and widths); accepted beside it: name, max_kv_size")
    base = policy(model, plan.scheme, name=name, **plan.overrides, **plan.options)
    spec = get_scheme(plan.scheme)
    decided = []
    for d in base.layers:
        if d.index not in plan.widths:
            if d.decision != BASELINE:
                raise ValueError(f"{where}: the policy quantizes layer {d.index} but the plan has no widths for it "
                                 f"(the plan decides layers {sorted(plan.widths)}: made for another model?)")
            decided.append(d)
            continue
        widths = plan.widths[d.index]
        if d.decision == BASELINE and widths is not None:
            raise ValueError(f"{where}: the plan quantizes layer {d.index}, which the policy keeps fp16 ({d.reason})")
        if widths is None:
            decided.append(replace(d, decision=BASELINE, reason="kept fp16 by the plan"))
            continue
        try:
            spec.resolve(**{**plan.options, **widths})
        except ValueError as err:
            raise ValueError(f"{where}: layer {d.index}: {err}") from None
        decided.append(replace(d, options=dict(widths), reason=f"{d.reason}; {widths_label(widths)} by the plan"))
    chosen = Policy(model, base.name, plan.scheme, base.options, decided, overrides=base.overrides,
                    environment=base.environment, plan=plan)
    return chosen.windowed(max_kv_size)


def make_cache(model: nn.Module, scheme: str | None = None, *, quiet: bool = False, name: str | None = None,
               max_kv_size: int | None = None, layers: list[int] | None = None, fp16_layers: list[int] | None = None,
               quantize_last: bool = False, quantize_sliding: bool = False, plan: Plan | dict | str | None = None,
               **options: Any) -> PromptCache:
    """Apply the policy and return the caches to pass as `prompt_cache`; prints the [kv] line unless quiet.

    `scheme`: default kvarn; `max_kv_size`: rolling windows of that many tokens for the growing attention layers;
    `layers`, `fp16_layers`, `quantize_last`, `quantize_sliding`: overrides of gmlx's rule; `plan`: per-layer
    widths from `gmlx_lab.plan` (see `policy`)."""
    chosen = policy(model, scheme, name=name, max_kv_size=max_kv_size, layers=layers, fp16_layers=fp16_layers,
                    quantize_last=quantize_last, quantize_sliding=quantize_sliding, plan=plan, **options)
    cache = chosen.make_cache()  # first: the [kv] line then says if a kernel failed its self-check
    if not quiet:
        print(chosen, file=sys.stdout)
    return cache
