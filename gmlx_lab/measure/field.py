"""The field side by side (issue 29): every registered scheme on the same models, texts and keys, at equal memory.

A run is cut into pieces small enough to restart: one model, one layer policy, one length, one kind of
measurement and one scheme family (the registry's scheme name) each. `benchmarks/field.py` runs them and writes
one JSON file per piece; `field_rows` reads them back as one flat row per (case, scheme), which the notebook and
the report share.

    pieces()                                    # every piece of the plan, in run order
    run_piece(piece, model, tokenizer)          # its JSON body: rows, result, sizes
    field_rows(benchmark_results("field-*"))    # the committed reports as rows (notebook 11)

Kinds: `fidelity` (teacher-forced decode KL against fp16, top-1 agreement, decode perplexity; gmlx_lab.measure.
fidelity) and `passkey` (greedy retrieval of a 5-digit key, 8 depths x 3 keys = 24 per length, with Wilson 95%
intervals; gmlx_lab.measure.experiments.passkey). Every row carries the scheme's cache bytes per token at the
case's length from its own byte formula (sink and tail included, layers the policy keeps fp16 counted as fp16),
and for fidelity also the resident bytes the cache really held (`nbytes`, growth reserve excluded).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..policy import policy
from ..registry import BASELINE, SCHEMES, get_scheme
from ..specs import parse_scheme_spec, scheme_label
from .experiments import passkey
from .fidelity import fidelity
from .metrics import wilson_interval
from .sizes import layer_shapes, policy_bytes
from .tradeoff import TradeoffPoint

__all__ = ["CASES", "DECODE", "FIELD_SPECS", "KINDS", "PASSKEY_DEPTHS", "PASSKEY_KEYS", "POLICIES", "Case", "Piece",
           "case_rows", "family_of", "shares_prefill", "field_points", "field_rows", "matchups", "pieces",
           "run_piece"]

# The schemes of the side by side, as specs. Widths and presets follow what each scheme's own project ships:
# affine_rot is llama.cpp's default since April 2026 (PR 21038, Hadamard rotation before q4_0/q8_0); kvarn keeps
# its default 1024-token fp16 tail (so at 1K tokens it stores nothing quantized: equal memory says so), and at
# KIVI's 128-token window too.
FIELD_SPECS: tuple[str, ...] = (
    "fp16",
    "affine4", "affine2",
    "affine_rot4", "affine_rot2",
    "kvarn2", "kvarn4", "kvarn6", "kvarn2:tail=128", "kvarn4:tail=128",
    "turboquant4", "turboquant:k3v4", "turboquant3", "turboquant4:qjl=1", "turboquant:k3v4,qjl=1", "turboquant3:qjl=1",
    "mxfp4", "nvfp4", "mxfp8", "mxfp4_rot", "nvfp4_rot", "mxfp8_rot",
    "kivi2", "kivi4",
)

POLICIES: dict[str, dict[str, Any]] = {
    "default": {},  # the model's own rule (Gemma 3 270M: global layers 5 and 11 only)
    "all": {"quantize_last": True, "quantize_sliding": True},  # every layer with a growing cache
}

KINDS = ("fidelity", "passkey")
DECODE = 64  # fidelity: decode tokens, one at a time through the cache, after a prefill of length - DECODE
PASSKEY_DEPTHS = tuple(round(0.05 + 0.9 * i / 7, 4) for i in range(8))  # the needle after this share of filler
PASSKEY_KEYS = 6  # keys per depth: 8 x 6 = 48 per scheme and length
PREFILL_STEP = 2048  # tokens per prefill chunk (experiments.passkey's default)
SEED = 0  # the same keys for every family (random_key draws in cell order)


@dataclass(frozen=True)
class Case:
    """One model under one layer policy at one length (tokens the cache holds)."""

    model: str
    policy: str
    length: int

    @property
    def name(self) -> str:
        return f"{self.model}.{self.policy}.{self.length // 1024}k"

    @property
    def inside_training(self) -> bool:
        """False where the length is past the context the model was trained on (its results then rank nothing)."""
        from ..models import TRAINED_CONTEXT

        return self.length <= TRAINED_CONTEXT.get(self.model, self.length)


CASES: tuple[Case, ...] = (
    Case("teaching-llama", "default", 1024), Case("teaching-llama", "default", 4096),
    Case("gemma3-270m", "default", 1024), Case("gemma3-270m", "all", 1024),
    Case("gemma3-270m", "default", 4096), Case("gemma3-270m", "all", 4096),
)


@dataclass(frozen=True)
class Piece:
    """One case, one kind, one scheme family: the unit that is run, written and skipped when done."""

    case: Case
    kind: str
    family: str  # a registry scheme name
    specs: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.case.name}.{self.kind}.{self.family}"


def family_of(spec: str) -> str | None:
    """The registry scheme a spec names, or None while it is not registered here (a scheme still to come)."""
    try:
        return parse_scheme_spec(spec)[0]
    except ValueError:
        return None


def pieces(specs: Iterable[str] = FIELD_SPECS, cases: Iterable[Case] = CASES,
           kinds: Iterable[str] = KINDS) -> tuple[list[Piece], list[str]]:
    """(the pieces of the plan in run order, the specs no registered scheme reads yet)."""
    families: dict[str, list[str]] = {}
    missing = []
    for spec in specs:
        family = family_of(spec)
        if family is None:
            missing.append(spec)
        else:
            families.setdefault(family, []).append(spec)
    out = [Piece(case, kind, family, tuple(group)) for case in cases for kind in kinds
           for family, group in families.items()]
    return out, missing


def shares_prefill(case: Case) -> bool:
    """Whether a passkey case prefills once in fp16 and lets each scheme store those K/V (experiments.stored_prefix).
    Not where sliding-window layers quantize and the context takes several prefill chunks: the fp16 rolling window
    then holds fewer tokens than it has seen, so every scheme of the case prefills through its own cache."""
    return not (POLICIES[case.policy].get("quantize_sliding") and case.length > PREFILL_STEP)


def _bytes_per_token(model: Any, spec: str, case: Case) -> tuple[float, float]:
    """(the scheme's bytes per token at the case's length, fp16's), both from the byte formulas."""
    scheme, options = parse_scheme_spec(spec)
    chosen = policy(model, scheme, **POLICIES[case.policy], **options)
    shapes = layer_shapes(chosen)
    ref = policy(model, BASELINE)
    return policy_bytes(chosen, case.length, shapes) / case.length, policy_bytes(ref, case.length, shapes) / case.length


def run_piece(piece: Piece, model: Any, tokenizer: Any, tokens: Sequence[int] | None = None,
              progress: bool = False) -> dict[str, Any]:
    """Measure one piece: {"rows": one flat dict per scheme, "result": the measurement's own to_dict(), ...}."""
    case = piece.case
    overrides = POLICIES[case.policy]
    runs, kept = [], {}
    for spec in piece.specs:
        scheme, options = parse_scheme_spec(spec)
        chosen = policy(model, scheme, **overrides, **options)
        runs.append(spec if chosen.scheme == BASELINE or not overrides else chosen)
        kept[spec] = {} if chosen.scheme == BASELINE else dict(Counter(  # why layers with K/V stayed fp16, counted
            d.reason.split(":")[0] for d in chosen.layers if d.k_head_dim and d.decision == BASELINE))
    sizes = {spec: _bytes_per_token(model, spec, case) for spec in piece.specs}
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    if piece.kind == "fidelity":
        if tokens is None:
            raise ValueError("a fidelity piece needs the evaluation text's token ids")
        result = fidelity(model, tokenizer, list(tokens), runs, prefill=case.length - DECODE, decode=DECODE,
                          progress=progress)
        for spec, s in zip(piece.specs, result.schemes):
            formula, fp16 = sizes[spec]
            rows.append({"spec": spec, "label": scheme_label(*parse_scheme_spec(spec)), "scheme": piece.family,
                         "bytes_per_token": formula, "fp16_bytes_per_token": fp16,
                         "resident_bytes_per_token": s.audit.resident / case.length,
                         "quantized_layers": s.quantized_layers, "decode_median_kl": s.decode_median_kl,
                         "decode_mean_kl": s.decode_mean_kl, "decode_p99_kl": s.decode_p99_kl, "top1": s.top1,
                         "perplexity": s.perplexity, "reference_perplexity": result.reference_perplexity,
                         "kept_fp16": kept[spec]})
        body = result.to_dict(per_position=False)
    elif piece.kind == "passkey":
        result = passkey(model, tokenizer, runs, [case.length], PASSKEY_DEPTHS, keys_per_cell=PASSKEY_KEYS,
                         seed=SEED, share_prefill=shares_prefill(case), progress=progress)
        for spec, label in zip(piece.specs, result.labels):
            hits = sum(t.correct for t in result.trials if t.label == label)
            asked = sum(1 for t in result.trials if t.label == label)
            low, high = wilson_interval(hits, asked)
            formula, fp16 = sizes[spec]
            rows.append({"spec": spec, "label": scheme_label(*parse_scheme_spec(spec)), "scheme": piece.family,
                         "bytes_per_token": formula, "fp16_bytes_per_token": fp16, "hits": hits, "asked": asked,
                         "accuracy": hits / asked, "wilson_low": low, "wilson_high": high, "kept_fp16": kept[spec]})
        body = result.to_dict()
    else:
        raise ValueError(f"unknown kind {piece.kind!r}; accepted: {', '.join(KINDS)}")
    return {"piece": piece.name, "model": case.model, "policy": case.policy, "overrides": overrides,
            "length": case.length, "kind": piece.kind, "family": piece.family, "specs": list(piece.specs),
            "seconds": round(time.perf_counter() - start, 1), "rows": rows, "result": body}


def field_rows(reports: dict[str, Any] | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every (case, scheme) row of the given field reports (`benchmark_results("field-*.json")` or a list of them),
    with the case, the kind and the machine that measured it. A piece measured on two machines appears twice."""
    items = reports.values() if isinstance(reports, dict) else reports
    out = []
    for report in items:
        for piece in report.get("pieces", {}).values():
            for row in piece["rows"]:
                out.append({"model": piece["model"], "policy": piece["policy"], "length": piece["length"],
                            "kind": piece["kind"], "machine": piece["machine"]["tag"], **row})
    return out



def case_rows(rows: list[dict[str, Any]], model: str, policy_name: str, length: int, kind: str) -> list[dict[str, Any]]:
    """The rows of one case and kind, from one machine (the one that measured most of its schemes; a GPU before the
    CPU on a tie), in the order of FIELD_SPECS. Empty when no report holds the case."""
    found = [r for r in rows if (r["model"], r["policy"], r["length"], r["kind"]) == (model, policy_name, length, kind)]
    if not found:
        return []
    count: dict[str, int] = {}
    for r in found:
        count[r["machine"]] = count.get(r["machine"], 0) + 1
    machine = max(count, key=lambda m: (count[m], m != "cpu"))
    order = {spec: i for i, spec in enumerate(FIELD_SPECS)}
    return sorted((r for r in found if r["machine"] == machine), key=lambda r: order.get(r["spec"], len(order)))


def field_points(rows: list[dict[str, Any]]) -> list[TradeoffPoint]:
    """The fidelity rows of one case as equal-memory points (gmlx_lab.measure.tradeoff), for `versus` and friends;
    rows of schemes not registered here are left out."""
    out = []
    for r in rows:
        if r["kind"] != "fidelity" or r["scheme"] not in SCHEMES:
            continue
        scheme, options = parse_scheme_spec(r["spec"])
        values = get_scheme(scheme).resolve(**options)
        bits = get_scheme(scheme).bits(values)
        kb, vb = (bits["k"], bits["v"]) if isinstance(bits, dict) else (bits, bits)
        out.append(TradeoffPoint(r["model"], r["label"], scheme, kb, vb, values.get("kv_tail_tokens"), r["length"],
                                 r["bytes_per_token"], r["fp16_bytes_per_token"], float(r["decode_median_kl"])))
    return out


def matchups(points: list[TradeoffPoint], ours: str, within: float = 0.05) -> list[tuple[TradeoffPoint, TradeoffPoint]]:
    """(ours, theirs) pairs at equal memory: for each point of another scheme, the `ours` point nearest in bytes per
    token, where the two differ by at most `within` x fp16's bytes per token. Points with KL 0 are left out."""
    mine = [p for p in points if p.scheme == ours and p.kl > 0]
    pairs = []
    for theirs in (p for p in points if p.scheme not in (ours, BASELINE) and p.kl > 0):
        near = sorted(mine, key=lambda p: abs(p.bytes_per_token - theirs.bytes_per_token))
        if near and abs(near[0].bytes_per_token - theirs.bytes_per_token) <= within * theirs.fp16_bytes_per_token:
            pairs.append((near[0], theirs))
    return pairs
