"""KV-cache fidelity: teacher-forced KL divergence of a quantized cache against the fp16 cache.

The same tokens run through the model twice, once with the fp16 cache and once
with the scheme's cache: the prefill part in chunks of `prefill_step`, then the
decode part ONE token at a time through the cache, which is where quantization
errors accumulate. At every position the next-token distributions are compared:
KL(p_fp16 || p_scheme) in nats (float32). The fp16 run is computed once and
shared by every scheme (docs/kvarn-spec.md section 5).

    result = fidelity(model, tokenizer, text, schemes=["affine4", "kvarn4:tail=128"], prefill=1400, decode=128)
    result                       # a table in Jupyter; result.to_markdown() elsewhere

Each run also audits its cache (`gmlx_lab.measure.audit`): every layer the policy reports as
quantized must really hold codes and fewer bytes than fp16 would. Schemes are named by specs
(`gmlx_lab.specs`: "affine4", "kvarn6:tail=128").
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..policy import Policy, PromptCache, policy
from ..registry import BASELINE

# the spec grammar and the audit have homes of their own; their names stay importable from here
from ..specs import SchemeLike, parse_scheme_spec, read_scheme_spec, scheme_label, spec_policy  # noqa: F401
from .audit import AuditError, AuditReport, LayerAudit, audit, fp16_equivalent  # noqa: F401
from .metrics import kl_from_logprobs, perplexity_from_nll

__all__ = ["FidelityResult", "SchemeFidelity", "SWEEPS", "fidelity", "layer_sensitivity", "only_layer", "sweep_specs"]

# -- results ----------------------------------------------------------------------------------------


def _fmt_kl(x: float) -> str:
    return f"{x:.5f}" if x >= 1e-4 or x == 0 else f"{x:.1e}"


PPL_NOTE = ("perplexity is measured against the text and KL against fp16: on one text a quantized cache can score "
            "a lower perplexity than fp16 by chance, so KL is the fidelity measure")


@dataclass
class SchemeFidelity:
    """One scheme against the fp16 reference: KL per position, top-1 agreement, perplexity, its audit."""

    spec: str
    label: str
    scheme: str
    options: dict[str, Any]
    prefill_kl: list[float]
    decode_kl: list[float]
    decode_top1: list[bool]
    decode_nll: list[float]
    policy: dict[str, Any]
    audit: AuditReport
    seconds: float

    @property
    def prefill_median_kl(self) -> float:
        return float(np.median(self.prefill_kl)) if self.prefill_kl else 0.0

    @property
    def decode_median_kl(self) -> float:
        return float(np.median(self.decode_kl))

    @property
    def decode_mean_kl(self) -> float:
        return float(np.mean(self.decode_kl))

    @property
    def decode_p99_kl(self) -> float:
        return float(np.percentile(self.decode_kl, 99))

    @property
    def top1(self) -> float:
        return float(np.mean(self.decode_top1))

    @property
    def perplexity(self) -> float:
        return perplexity_from_nll(self.decode_nll)

    @property
    def quantized_layers(self) -> str:
        return f"{self.policy['quantized_layers']}/{len(self.policy['layers'])}"

    def summary(self) -> dict[str, Any]:
        """The headline numbers as a flat dict."""
        return {
            "label": self.label, "spec": self.spec, "quantized_layers": self.quantized_layers,
            "cache_bytes": self.audit.resident, "fp16_bytes": self.audit.fp16_bytes,
            "prefill_median_kl": self.prefill_median_kl, "decode_median_kl": self.decode_median_kl,
            "decode_mean_kl": self.decode_mean_kl, "decode_p99_kl": self.decode_p99_kl,
            "decode_top1": self.top1, "perplexity": self.perplexity, "seconds": round(self.seconds, 2),
        }

    def to_dict(self, per_position: bool = True) -> dict[str, Any]:
        out = {**self.summary(), "scheme": self.scheme, "options": self.options, "policy": self.policy,
               "audit": self.audit.to_dict()}
        if per_position:
            out.update(prefill_kl=self.prefill_kl, decode_kl=self.decode_kl, decode_top1=self.decode_top1)
        return out


@dataclass
class FidelityResult:
    """Every scheme of one fidelity run, with the setup; a table in Jupyter."""

    model: str
    prefill: int
    decode: int
    prefill_step: int
    reference_perplexity: float
    schemes: list[SchemeFidelity] = field(default_factory=list)
    reference_seconds: float = 0.0

    def __getitem__(self, label: str) -> SchemeFidelity:
        for s in self.schemes:
            if label in (s.label, s.spec):
                return s
        raise KeyError(label)

    def to_dict(self, per_position: bool = True) -> dict[str, Any]:
        return {"model": self.model, "prefill": self.prefill, "decode": self.decode,
                "prefill_step": self.prefill_step, "reference_perplexity": self.reference_perplexity,
                "reference_seconds": round(self.reference_seconds, 2),
                "schemes": [s.to_dict(per_position) for s in self.schemes]}

    def to_markdown(self) -> str:
        """One row per scheme: cache size against fp16, KL summaries, top-1 agreement, perplexity."""
        head = ("| scheme | quantized layers | cache KiB (% fp16) | prefill median KL | decode median KL "
                "| decode p99 KL | decode top-1 | decode ppl |\n|---|---|---|---|---|---|---|---|")
        rows = [head]
        for s in self.schemes:
            pct = 100 * s.audit.resident / max(s.audit.fp16_bytes, 1)
            rows.append(f"| {s.label} | {s.quantized_layers} | {s.audit.resident / 1024:.0f} ({pct:.1f}%) "
                        f"| {_fmt_kl(s.prefill_median_kl)} | {_fmt_kl(s.decode_median_kl)} "
                        f"| {_fmt_kl(s.decode_p99_kl)} | {100 * s.top1:.1f}% | {s.perplexity:.3f} |")
        note = (f"\n\n{self.model}: prefill {self.prefill} tokens (step {self.prefill_step}), decode {self.decode} "
                f"tokens one at a time; KL(fp16 || scheme) in nats; fp16 decode ppl {self.reference_perplexity:.3f}; "
                f"{PPL_NOTE}")
        return "\n".join(rows) + note

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def _repr_html_(self) -> str:
        cols = ["scheme", "layers q", "cache % fp16", "prefill med KL", "decode med KL", "decode p99 KL",
                "top-1", "ppl"]
        body = "".join(
            f"<tr><td>{s.label}</td><td>{s.quantized_layers}</td>"
            f"<td>{100 * s.audit.resident / max(s.audit.fp16_bytes, 1):.1f}%</td>"
            f"<td>{_fmt_kl(s.prefill_median_kl)}</td><td>{_fmt_kl(s.decode_median_kl)}</td>"
            f"<td>{_fmt_kl(s.decode_p99_kl)}</td><td>{100 * s.top1:.1f}%</td><td>{s.perplexity:.3f}</td></tr>"
            for s in self.schemes)
        head = "".join(f"<th>{c}</th>" for c in cols)
        caption = (f"{self.model}: prefill {self.prefill}, decode {self.decode} one token at a time; "
                   f"KL(fp16 || scheme) in nats; {PPL_NOTE}")
        return f"<table><caption>{caption}</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def figure_kl(self, log: bool = True) -> Any:
        """Plotly figure: KL per position per scheme (prefill then decode, a line marks the boundary)."""
        import plotly.graph_objects as go

        fig = go.Figure()
        for s in self.schemes:
            kl = s.prefill_kl + s.decode_kl
            y = [max(v, 1e-9) for v in kl] if log else kl
            fig.add_scatter(x=list(range(len(kl))), y=y, mode="lines", name=s.label)
        fig.add_vline(x=len(self.schemes[0].prefill_kl) - 0.5 if self.schemes else 0, line_dash="dash",
                      annotation_text="decode starts")
        fig.update_layout(title=f"KL(fp16 || scheme) per position, {self.model}", xaxis_title="position",
                          yaxis_title="KL (nats)", yaxis_type="log" if log else "linear")
        return fig

    def figure_summary(self) -> Any:
        """Plotly figure: decode median KL per scheme (bars), with top-1 agreement in the hover text."""
        import plotly.graph_objects as go

        fig = go.Figure(go.Bar(
            x=[s.label for s in self.schemes], y=[max(s.decode_median_kl, 1e-9) for s in self.schemes],
            hovertext=[f"top-1 {100 * s.top1:.1f}%, p99 {s.decode_p99_kl:.2e}" for s in self.schemes]))
        fig.update_layout(title=f"decode median KL, {self.model}", yaxis_type="log", yaxis_title="KL (nats)")
        return fig


# -- the run ----------------------------------------------------------------------------------------


@dataclass
class _Trace:
    logp: list[mx.array]  # reference only: float32 log-softmax per chunk / step
    prefill_kl: list[float]
    decode_kl: list[float]
    decode_top1: list[bool]
    decode_nll: list[float]
    seconds: float


def _logp(logits: mx.array) -> mx.array:
    x = logits[0].astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _teacher_forced(model: nn.Module, tokens: mx.array, cache: PromptCache, prefill: int, decode: int,
                    prefill_step: int, ref: _Trace | None, bar: Any = None) -> _Trace:
    """Run prefill in chunks, then decode one token at a time, comparing with `ref` (None: keep log-probs)."""
    keep, kl_parts, dec_kl, dec_top1, dec_nll = [], [], [], [], []
    start_time = time.perf_counter()
    chunks = [(s, min(s + prefill_step, prefill)) for s in range(0, prefill, prefill_step)]
    steps = chunks + [(p, p + 1) for p in range(prefill, prefill + decode)]
    for i, (a, b) in enumerate(steps):
        logp = _logp(model(tokens[None, a:b], cache=cache))
        target = tokens[a + 1:b + 1]
        nll = -mx.take_along_axis(logp, target[:, None], axis=-1)[:, 0]
        if ref is None:
            keep.append(logp)
            kl, top1 = mx.zeros(b - a), mx.ones(b - a, dtype=mx.bool_)
        else:
            kl = kl_from_logprobs(ref.logp[i], logp)
            top1 = mx.argmax(ref.logp[i], axis=-1) == mx.argmax(logp, axis=-1)
        mx.eval(kl, top1, nll, *(keep[-1:] if ref is None else ()))
        if i < len(chunks):
            kl_parts.extend(kl.tolist())
        else:
            dec_kl.append(kl.item())
            dec_top1.append(bool(top1.item()))
            dec_nll.append(nll.item())
        if bar is not None:
            bar.update(b - a)
    return _Trace(keep, kl_parts, dec_kl, dec_top1, dec_nll, time.perf_counter() - start_time)


def _tokens(tokenizer: Any, text_or_tokens: str | Sequence[int] | mx.array) -> mx.array:
    if isinstance(text_or_tokens, str):
        if tokenizer is None:
            raise ValueError("a tokenizer is needed to score text; pass token ids instead")
        return mx.array(tokenizer.encode(text_or_tokens), dtype=mx.int32)
    return mx.array(text_or_tokens, dtype=mx.int32).reshape(-1)


def fidelity(
    model: nn.Module,
    tokenizer: Any,
    text_or_tokens: str | Sequence[int] | mx.array,
    schemes: Iterable[SchemeLike] = ("affine4", "affine8", "kvarn4:tail=128", "kvarn6:tail=128"),
    prefill: int = 1400,
    decode: int = 128,
    *,
    prefill_step: int = 2048,
    reuse_reference: bool = True,
    progress: bool = False,
    reference: Policy | None = None,
) -> FidelityResult:
    """Teacher-forced KL(fp16 || scheme) of each scheme's cache, per position, against one shared fp16 run.

    Needs prefill + decode + 1 tokens (the last one is only a target). Schemes are specs
    ("kvarn6:tail=128"), (scheme, options) pairs or Policy objects (e.g. one layer quantized).
    With `reuse_reference`, an "fp16" entry is the reference run itself (KL exactly 0).
    `reference`: the fp16 policy to compare against (default the plain fp16 cache; e.g. an fp16 rolling
    window, `policy(model, "fp16", max_kv_size=N)`, to measure windowed schemes).
    """
    tokens = _tokens(tokenizer, text_or_tokens)
    if prefill < 1 or decode < 1:
        raise ValueError(f"prefill and decode must be >= 1, got prefill={prefill}, decode={decode}")
    if prefill_step < 1:
        raise ValueError(f"prefill_step must be >= 1, got {prefill_step}")
    need = prefill + decode + 1
    if tokens.size < need:
        raise ValueError(f"prefill {prefill} + decode {decode} needs {need} tokens; the text has {tokens.size}")
    tokens = tokens[:need]
    candidates = [spec_policy(model, s) for s in schemes]  # parse every spec before any long run
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=(len(candidates) + 1) * (prefill + decode), desc="fidelity", unit="tok", leave=False)
    ref_policy = reference or policy(model, BASELINE)
    if ref_policy.scheme != BASELINE:
        raise ValueError(f"the reference must be an fp16 policy, got {ref_policy.label}")
    ref_cache = ref_policy.make_cache()
    ref = _teacher_forced(model, tokens, ref_cache, prefill, decode, prefill_step, None, bar)
    result = FidelityResult(getattr(model, "gmlx_name", None) or ref_policy.name, prefill, decode, prefill_step,
                            perplexity_from_nll(ref.decode_nll), reference_seconds=ref.seconds)
    for spec, chosen in candidates:
        if bar is not None:
            bar.set_postfix_str(chosen.label)
        if reuse_reference and chosen.scheme == BASELINE and chosen.max_kv_size == ref_policy.max_kv_size:
            trace, cache = replace(ref, prefill_kl=[0.0] * prefill, decode_kl=[0.0] * decode,
                                   decode_top1=[True] * decode), ref_cache
            if bar is not None:
                bar.update(prefill + decode)
        else:
            cache = chosen.make_cache()
            trace = _teacher_forced(model, tokens, cache, prefill, decode, prefill_step, ref, bar)
        result.schemes.append(SchemeFidelity(
            spec, chosen.label, chosen.scheme, dict(chosen.options), trace.prefill_kl, trace.decode_kl,
            trace.decode_top1, trace.decode_nll, chosen.as_dict(), audit(cache), trace.seconds))
        del cache
    if bar is not None:
        bar.close()
    return result


# -- sweeps -----------------------------------------------------------------------------------------

SWEEPS: dict[str, list[str]] = {
    "widths": ["fp16"] + [f"affine{b}" for b in (2, 3, 4, 6, 8)]
    + [f"kvarn{b}:tail={t}" for t in (0, 128) for b in (2, 3, 4, 5, 6, 8)],
    "tails": [f"kvarn{b}:tail={t}" for b in (2, 4, 6) for t in (0, 128, 1024)],
    "split": ["kvarn:k8v4,tail=128", "kvarn:k4v8,tail=128", "kvarn4:tail=128", "kvarn8:tail=128", "affine4",
              "affine8"],
    "ladder": [f"{s}{b}{options}" for b in (2, 3, 4) for s, options in
               (("affine", ""), ("affine_rot", ""), ("kvarn", ":tail=128"))],
}


def sweep_specs(name: str) -> list[str]:
    """The scheme specs of a named sweep (see SWEEPS): widths, tails, split, ladder."""
    if name not in SWEEPS:
        raise ValueError(f"unknown sweep {name!r}; accepted: {', '.join(SWEEPS)}, layers")
    return list(SWEEPS[name])


def single_layer_policy(model: nn.Module, spec: str | tuple[str, dict[str, Any]], layer: int) -> Policy:
    """The scheme's policy with every layer fp16 except `layer` (quantized even if the rule keeps it fp16)."""
    scheme, options = read_scheme_spec(spec)
    base = policy(model, scheme, **options)
    if not 0 <= layer < len(base.layers):
        raise ValueError(f"layer {layer} does not exist; the model has {len(base.layers)} cache entries")
    target = base.layers[layer]
    if not target.grows:
        raise ValueError(f"layer {layer} is {target.kind}: it has no growing K/V cache to quantize")
    if target.decision == BASELINE and target.reason != "last of deep stack":
        raise ValueError(f"layer {layer} cannot use {scheme}: {target.reason}")
    return only_layer(base, layer)


def only_layer(base: Policy, layer: int, widths: dict[str, int] | None = None) -> Policy:
    """`base` with only `layer` quantized (at its own `widths` if given, a plan's per-layer options), every other
    layer fp16: a sensitivity probe."""
    layers = [replace(d, decision=base.scheme, reason="sensitivity probe: only this layer quantized",
                      options=dict(widths or {}))
              if d.index == layer else replace(d, decision=BASELINE, reason="sensitivity probe", options={})
              for d in base.layers]
    return Policy(base.model, base.name, base.scheme, base.options, layers, environment=base.environment)


def layer_sensitivity(model: nn.Module, tokenizer: Any, text_or_tokens: str | Sequence[int] | mx.array,
                      spec: str = "kvarn4:tail=0", *, layers: Sequence[int] | None = None,
                      **kwargs: Any) -> FidelityResult:
    """Quantize one layer at a time (all others fp16): which layers' caches the output is most sensitive to."""
    scheme, options = read_scheme_spec(spec)
    base = policy(model, scheme, **options)
    chosen = [d.index for d in base.layers if d.grows] if layers is None else list(layers)
    policies = [single_layer_policy(model, spec, i) for i in chosen]
    result = fidelity(model, tokenizer, text_or_tokens, schemes=policies, **kwargs)
    for i, s in zip(chosen, result.schemes):
        s.label = f"{s.label} layer {i}"
    return result

