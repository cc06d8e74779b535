"""Your model: which rows fit its cache under a budget, and what the nearest committed measurement says of them.

    advice = advise(model, context=8192, budget=0.3)
    print(advice.text())

The bytes are your model's own: every scheme of the verdict through its policy (which layers it quantizes) and
byte formula (`sizes.policy_bytes`) at your context. The fidelity is borrowed: mean KL and top-1 agreement of the
same scheme on the committed model whose policy quantizes the nearest share of its layers (a model of sliding
windows is answered from Gemma, a model whose every layer grows from SmolLM2), at the committed context nearest
to yours; a row that stored nothing quantized there (its fp16 tail held the whole context) lends nothing.
`verdict.recommend` then reads the borrowed rows as it reads measured ones. A borrowed KL is a guide, not a
measurement of your model: `plan_command` is what measures it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.nn as nn

from ..paths import RESULTS_DIR
from ..policy import model_name, policy
from ..registry import BASELINE
from ..specs import read_scheme_spec
from .banded import Row
from .sizes import layer_shapes, policy_bytes
from .speed import SpeedTable
from .verdict import METRIC, Recommendation, VerdictResults, context_label, keeps_model, load_verdict, recommend


def quantized_share(label: str) -> float:
    """A row's 'quantized/total' layers as a share ("29/30" -> 0.967)."""
    done, total = (int(x) for x in label.split("/"))
    return done / total


def measured_models() -> list[str]:
    """The models with a committed verdict file."""
    return sorted({p.name.removeprefix("verdict-").rsplit("-", 1)[0] for p in RESULTS_DIR.glob("verdict-*.json")})


def nearest_evidence(layer_share: float, context: int) -> tuple[VerdictResults, int]:
    """(the committed results whose policy quantizes the nearest share of layers, more contexts first on a tie;
    its context nearest to `context` on a log scale)."""
    found = []
    for name in measured_models():
        results = load_verdict(name)
        if not results.contexts:
            continue
        share = max(quantized_share(r.quantized_layers) for r in results.rows if r.scheme != BASELINE)
        found.append((abs(share - layer_share), -len(results.contexts), name, results))
    if not found:
        raise FileNotFoundError("no committed verdict file to borrow fidelity from; run benchmarks/verdict.py")
    results = min(found, key=lambda f: f[:3])[3]
    near = min(results.contexts, key=lambda c: abs(math.log2(c / context)))
    return results, near


@dataclass(frozen=True)
class Advice:
    """Your model's rows (its bytes, the evidence's fidelity) and the recommendation read from them."""

    model: str
    context: int
    budget: float
    layers: str  # layers the verdict's schemes quantize on your model, e.g. "31/32"
    rows: VerdictResults  # one row a scheme: your model's bytes at `context`, the evidence row's passages
    evidence: VerdictResults
    evidence_context: int
    recommendation: Recommendation

    @property
    def fitting(self) -> list[Row]:
        """The rows whose bytes on your model fit the budget, lowest mean KL first."""
        return sorted((r for r in self.rows.rows if r.scheme != BASELINE and r.share <= self.budget),
                      key=lambda r: r.interval(METRIC).estimate)

    def plan_command(self, model_arg: str) -> str:
        """The `gmlx-lab plan` command that measures the recommended scheme on your model, layer by layer."""
        row = self.recommendation.pick or self.recommendation.broken
        scheme, options = read_scheme_spec(row.spec) if row else ("kvarn", {"kv_tail_tokens": 128})
        rest = [f"{k}={v}" for k, v in options.items() if k not in ("bits", "k_bits", "v_bits")]
        spec = scheme + (":" + ",".join(rest) if rest else "")
        return (f"gmlx-lab plan --model {model_arg} --scheme {spec} --budget {self.budget:g} "
                f"--context {self.context} --measure")

    def table(self) -> list[dict[str, str]]:
        """The fitting rows as table cells: your share, the borrowed mean KL and top-1, whether it keeps the model."""
        return [{"scheme": r.label, "% of fp16's bytes (yours)": f"{100 * r.share:.1f}",
                 f"mean KL ({self.evidence.model}, {context_label(self.evidence_context)})":
                     r.interval(METRIC).text(), "top-1": r.interval("top1").text(),
                 "keeps the model": "yes" if keeps_model(r) else "no"} for r in self.fitting]

    def text(self, model_arg: str | None = None) -> str:
        """What fits, where the fidelity comes from, the recommendation, and the command that measures it."""
        fits = self.fitting
        lines = [f"{self.model} at {context_label(self.context)} tokens under {100 * self.budget:.0f}% of fp16's "
                 f"bytes: {len(fits)} of {len(self.rows.rows) - 1} rows fit by the byte formulas (the verdict's "
                 f"schemes quantize {self.layers} layers of this model).",
                 f"Fidelity borrowed from {self.evidence.model} at {context_label(self.evidence_context)} tokens "
                 f"(the measured model whose policy quantizes the nearest share of its layers; "
                 f"{self.evidence.path.name if self.evidence.path else 'its results'}).",
                 self.recommendation.text()]
        lines.append("Measure it on this model: " + self.plan_command(model_arg or self.model))
        return "\n".join(lines)


def advise(model: nn.Module, context: int, budget: float, speeds: SpeedTable | None = None,
           name: str | None = None) -> Advice:
    """Every verdict scheme's bytes on `model` at `context`, the nearest measured fidelity beside them, and the
    recommendation under `budget` (see the module docstring)."""
    if context < 1:
        raise ValueError(f"context is a number of tokens, at least 1; got {context}")
    if not 0 < budget <= 1:
        raise ValueError(f"budget is a share of fp16's bytes in (0, 1], got {budget}")
    name = name or model_name(model)
    reference = policy(model, BASELINE)
    shapes = layer_shapes(reference)
    fp16_bytes = policy_bytes(reference, context, shapes)
    probe = policy(model, "affine", bits=4)
    layers = f"{len(probe.quantized)}/{len(probe.layers)}"
    evidence, near = nearest_evidence(quantized_share(layers), context)
    rows = []
    for found in evidence.at(near):
        if found.scheme != BASELINE and found.share >= 1:
            continue  # it stored nothing quantized at the evidence's context (its fp16 tail held it all)
        scheme, options = read_scheme_spec(found.spec)
        chosen = policy(model, scheme, **options)
        quantized = len(chosen.quantized) if scheme != BASELINE else 0
        if scheme != BASELINE and quantized == 0:
            continue  # the scheme takes no layer of this model: it would be fp16 under another name
        rows.append(Row(found.spec, chosen.label, scheme, context, f"{quantized}/{len(chosen.layers)}",
                        policy_bytes(chosen, context, shapes), fp16_bytes, found.per_passage))
    yours = VerdictResults(f"{name} (bytes) with {evidence.model}'s fidelity", rows, evidence.runs, evidence.path)
    return Advice(name, context, budget, layers, yours, evidence, near, recommend(yours, budget, context, speeds))
