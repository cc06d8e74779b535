"""The cache audit: does every layer store what its policy reports?

A quantized layer must be the scheme's cache class, pass the scheme's own checks (`Scheme.audit`: widths,
codes stored once due) and hold fewer resident bytes than fp16 would for the same tokens. `fidelity` audits
each cache it runs; the command line's `audit` runs it alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..cache import GmlxCache
from ..policy import PromptCache
from ..registry import BASELINE, get_scheme

__all__ = ["AuditError", "AuditReport", "LayerAudit", "audit", "fp16_equivalent"]

class AuditError(AssertionError):
    """A cache does not store what its policy says (a layer reported quantized holds fp16, ...)."""


@dataclass
class LayerAudit:
    """One cache entry: what the policy says, what the cache class is, and the bytes it holds."""

    index: int
    decision: str
    cache_class: str
    tokens: int
    regions: dict[str, int]
    resident: int  # bytes holding tokens (growth reserve excluded)
    fp16_bytes: int  # what FP16Cache would hold for the same tokens
    ok: bool
    note: str = ""


@dataclass
class AuditReport:
    """The audit of a whole PromptCache."""

    label: str
    layers: list[LayerAudit]

    @property
    def resident(self) -> int:
        return sum(a.resident for a in self.layers)

    @property
    def fp16_bytes(self) -> int:
        return sum(a.fp16_bytes for a in self.layers)

    @property
    def ok(self) -> bool:
        return all(a.ok for a in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "ok": self.ok, "resident": self.resident, "fp16_bytes": self.fp16_bytes,
                "layers": [asdict(a) for a in self.layers]}


def fp16_equivalent(cache: Any, decision: Any) -> int:
    """Bytes an fp16 cache would hold for the tokens `cache` holds (batch x heads x tokens x (Dk+Dv) x 2)."""
    if not isinstance(cache, GmlxCache) or decision.kv_heads is None:
        return cache.nbytes
    shape = cache.kv_shape
    batch = 1 if shape is None else shape[0]
    return batch * decision.kv_heads * cache.held * (decision.k_head_dim + decision.v_head_dim) * 2


def _check_layer(cache: Any, d: Any, options: dict[str, Any]) -> str:
    """Why this entry does not match its policy decision ('' when it does)."""
    if d.decision == BASELINE:
        if isinstance(cache, GmlxCache) and cache.scheme != BASELINE:
            return f"policy says {BASELINE} but the cache is {type(cache).__name__}"
        return ""
    spec = get_scheme(d.decision)
    if not isinstance(cache, spec.cache_class) or getattr(cache, "scheme", None) != d.decision:
        return f"policy says {d.decision} but the cache is {type(cache).__name__}"
    problem, quantized_now = spec.audit(cache, options)
    if problem:
        return problem
    resident = sum(v for k, v in cache.regions().items() if k != "reserve")
    if quantized_now and resident >= fp16_equivalent(cache, d):
        return f"holds {resident} bytes, not below fp16's {fp16_equivalent(cache, d)}"
    return ""


def audit(prompt_cache: PromptCache, *, strict: bool = True) -> AuditReport:
    """Check every layer stores what the policy reports; raise AuditError naming the layers that do not.

    A quantized layer must be the scheme's cache class, pass the scheme's own checks (`Scheme.audit`:
    widths, codes stored once due) and hold fewer resident bytes than fp16 for the same tokens (once it
    is past its fp16 phase: kvarn's sink and tail, affine's quantized_kv_start). `strict=False` returns
    the report instead of raising.
    """
    chosen = getattr(prompt_cache, "policy", None)
    if chosen is None:
        raise ValueError("audit needs a PromptCache built by gmlx_lab.make_cache (it carries the policy)")
    if len(prompt_cache) != len(chosen.layers):
        raise AuditError(f"{chosen.label}: {len(prompt_cache)} cache entries, policy has {len(chosen.layers)}")
    layers = []
    for cache, d in zip(prompt_cache, chosen.layers):
        note = _check_layer(cache, d, chosen.layer_options(d.index))
        regions = cache.regions() if isinstance(cache, GmlxCache) else {"native": cache.nbytes}
        resident = sum(v for k, v in regions.items() if k != "reserve")
        layers.append(LayerAudit(d.index, d.decision, type(cache).__name__, getattr(cache, "offset", 0),
                                 regions, resident, fp16_equivalent(cache, d), not note, note))
    report = AuditReport(chosen.label, layers)
    if strict and not report.ok:
        bad = "; ".join(f"layer {a.index}: {a.note}" for a in layers if not a.ok)
        raise AuditError(f"cache audit failed for {chosen.label}: {bad}")
    return report
