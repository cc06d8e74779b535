"""The `gmlx-lab` command: compare, fidelity, policy, plan, memory, passkey, draft, weights-kv, lab and book.

    gmlx-lab policy llama                      # the [kv] line and per-layer decisions of a specimen
    gmlx-lab fidelity --schemes affine4,kvarn4:tail=128 --prefill 1400 --decode 128
    gmlx-lab compare --schemes fp16,affine2,kvarn6
    gmlx-lab memory --context 4096
    gmlx-lab plan --scheme kvarn:tail=128 --budget 0.45 --context 2048 --out plan.json   # per-layer widths
    gmlx-lab compare --plan plan.json          # generation under the plan (policy --plan: its decisions)
    gmlx-lab passkey --schemes fp16,affine2,kvarn2:tail=0 --lengths 1024,2048   # Gemma 3 270M by default
    gmlx-lab draft --schemes fp16,affine4,kvarn4:tail=0 --draft-layers 4
    gmlx-lab weights-kv --weight-bits fp16,8,4,3 --schemes fp16,affine4,kvarn4:tail=0
    gmlx-lab lab                               # JupyterLab on the notebooks/ folder
    gmlx-lab book                              # every notebook run, as a static site in build/book/
    gmlx-lab --plugin my_scheme fidelity --schemes affine4,mine4   # a plug-in registers its schemes first

Overrides of gmlx's per-layer rule, for exploration (compare, fidelity, memory, policy): `--quantize-layers 5,11`
(only these), `--fp16-layers 3`, `--quantize-last`, `--quantize-sliding` (see gmlx_lab.policy.Overrides).
`--model` picks the model: the bundled teaching-llama by default, "smollm2-135m", "gemma3-270m",
a specimen family (llama, gpt_oss, ...: random weights, no tokenizer) or a folder.
Errors print one line, `gmlx-lab: error: ...`, and exit non-zero.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import mlx.nn as nn

from .plugins import load_plugin

PACKAGE_DIR = Path(__file__).resolve().parent
EVAL_TEXT = PACKAGE_DIR / "data" / "eval_text.txt"
FIDELITY_SCHEMES = "fp16,affine4,affine8,kvarn4:tail=128,kvarn4,kvarn6"
COMPARE_SCHEMES = "fp16,affine2,affine4,kvarn4:tail=128,kvarn6:tail=128"
MEMORY_SCHEMES = "fp16,affine4,affine8,kvarn4,kvarn6,kvarn6:tail=128"
PASSKEY_SCHEMES = "fp16,affine2,affine4,kvarn2:tail=0,kvarn2:tail=128"
DRAFT_SCHEMES = "fp16,affine2,affine4,kvarn2:tail=0,kvarn4:tail=0"
WEIGHTS_KV_SCHEMES = "fp16,affine4,kvarn4:tail=0"


def load_model(name: str | None) -> tuple[nn.Module, Any]:
    """(model, tokenizer): the bundled model (None), a specimen family (tokenizer None) or what `load` opens."""
    from .models import FAMILIES, load, specimen

    if name in FAMILIES:
        return specimen(name), None
    return load(name)


def encode(tokenizer: Any, model: nn.Module, text: str) -> list[int]:
    """Token ids of `text`; specimens have no tokenizer, so their ids are the text's UTF-8 bytes."""
    if tokenizer is not None:
        return list(tokenizer.encode(text))
    vocab = getattr(getattr(model, "args", None), "vocab_size", 256)
    return [b % vocab for b in text.encode()]


def _read_text(path: str | None) -> str:
    file = Path(path) if path else EVAL_TEXT
    if not file.is_file():
        raise FileNotFoundError(f"text file {file} not found")
    return file.read_text(encoding="utf-8")


def scheme_list(text: str, extra: tuple[str, ...] = ()) -> list[str]:
    """Split a scheme list "fp16,affine4,kvarn6:tail=128" (commas inside options stay with their scheme).

    Every spec is checked against the registry; names in `extra` (e.g. a benchmark's own baselines) pass as is.
    """
    from .registry import spec_prefixes
    from .specs import parse_scheme_spec

    specs: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        option = "=" in part or re.fullmatch(r"k\d+v\d+", part)
        if specs and option and not any(part.startswith(word) for word, _, _ in spec_prefixes()):
            specs[-1] += "," + part  # an option of the previous scheme, e.g. "kvarn:k8v4,tail=128"
        else:
            specs.append(part)
    if not specs:
        raise ValueError("--schemes is empty")
    for spec in specs:
        if spec not in extra:
            parse_scheme_spec(spec)
    return specs


def layer_list(text: str | None, flag: str) -> list[int] | None:
    """"5,11" -> [5, 11] (None stays None); the policy checks the range against the model."""
    if text is None:
        return None
    try:
        return number_list(text)
    except ValueError as err:
        raise ValueError(f"{flag} {text!r}: {err}; accepted: comma-separated layer indices such as 5,11") from None


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The policy override arguments given on the command line (empty: gmlx's rule)."""
    out: dict[str, Any] = {}
    chosen = layer_list(args.quantize_layers, "--quantize-layers")
    kept = layer_list(args.fp16_layers, "--fp16-layers")
    if chosen is not None:
        out["layers"] = chosen
    if kept is not None:
        out["fp16_layers"] = kept
    if args.quantize_last:
        out["quantize_last"] = True
    if args.quantize_sliding:
        out["quantize_sliding"] = True
    return out


def spec_policies(model: nn.Module, specs: list[str], args: argparse.Namespace) -> list[Any]:
    """The specs as they are (gmlx's rule), or as Policy objects with the command line's overrides."""
    from .policy import policy
    from .specs import read_scheme_spec

    given = overrides(args)
    if not given:
        return list(specs)
    chosen = []
    for spec in specs:
        scheme, options = read_scheme_spec(spec)
        chosen.append(policy(model, scheme, **given, **options))
    return chosen


# -- subcommands ------------------------------------------------------------------------------------


def cmd_policy(args: argparse.Namespace) -> int:
    from .policy import policy
    from .specs import read_scheme_spec

    specs = scheme_list(args.schemes)
    model, _ = load_model(args.model_name)
    reports = []
    chosen_all = [policy(model, plan=args.plan)] if args.plan else \
        [policy(model, s, **overrides(args), **o) for s, o in map(read_scheme_spec, specs)]
    for chosen in chosen_all:
        reports.append(chosen.as_dict())
        if args.json:
            continue
        print(chosen)
        print("| layer | kind | cache | kv heads | head dim | decision | reason |")
        print("|---|---|---|---|---|---|---|")
        for d in chosen.layers:
            dims = d.k_head_dim if d.k_head_dim == d.v_head_dim else f"{d.k_head_dim}/{d.v_head_dim}"
            print(f"| {d.index} | {d.kind} | {d.cache_class} | {d.kv_heads if d.kv_heads is not None else '-'} "
                  f"| {dims if d.k_head_dim is not None else '-'} | {d.decision} | {d.reason} |")
        print()
    if args.json:
        print(json.dumps(reports, indent=2))
    return 0


def cmd_fidelity(args: argparse.Namespace) -> int:
    from .measure.fidelity import fidelity, layer_sensitivity, sweep_specs

    specs = sweep_specs(args.sweep) if args.sweep and args.sweep != "layers" else scheme_list(args.schemes)
    text = _read_text(args.text_file)
    model, tokenizer = load_model(args.model)
    tokens = encode(tokenizer, model, text)
    common = {"prefill": args.prefill, "decode": args.decode, "prefill_step": args.prefill_step,
              "progress": not args.quiet}
    t0 = time.perf_counter()
    if args.sweep == "layers":
        if overrides(args):
            raise ValueError("--sweep layers quantizes one layer at a time: it takes no policy overrides")
        result = layer_sensitivity(model, tokenizer, tokens, specs[0], **common)
    else:
        result = fidelity(model, tokenizer, tokens, spec_policies(model, specs, args), **common)
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({**result.to_dict(per_position=False), "seconds": round(seconds, 1)}, indent=2))
    else:
        print(result.to_markdown())
        print(f"({seconds:.1f} s)")
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from .measure.memory import memory_report

    specs = scheme_list(args.schemes)
    model, _ = load_model(args.model)
    report = memory_report(model, spec_policies(model, specs, args), context=args.context,
                           max_kv_size=args.max_kv_size)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    print(report.to_markdown())
    if args.layers:
        for s in report.schemes:
            print(f"\n{s.label}\n{report.layers_markdown(s.label)}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .kv_inspect import first_divergence, greedy
    from .measure.audit import audit
    from .policy import policy
    from .specs import read_scheme_spec

    specs = scheme_list(args.schemes)
    model, tokenizer = load_model(args.model)
    if args.prompt is not None:
        prompt = encode(tokenizer, model, args.prompt)
    else:
        prompt = encode(tokenizer, model, _read_text(args.prompt_file))[: args.prompt_tokens]
    if not prompt:
        raise ValueError("the prompt is empty")

    def show(ids: list[int]) -> str:
        return tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))

    reference: list[int] | None = None
    rows = []
    chosen_all = [policy(model, s, max_kv_size=args.max_kv_size, **overrides(args), **o)
                  for s, o in map(read_scheme_spec, specs)]
    if args.plan:
        chosen_all.append(policy(model, plan=args.plan, max_kv_size=args.max_kv_size))
    for chosen in chosen_all:
        cache = chosen.make_cache()
        tokens, prefill_s, rate = greedy(model, prompt, cache, args.max_tokens)
        report = audit(cache)
        reference = tokens if reference is None else reference
        diverge = first_divergence(tokens, reference)
        text = show(tokens) if diverge is None else show(tokens[:diverge]) + " ⟨≠⟩" + show(tokens[diverge:])
        where = "same as first" if diverge is None else f"diverges at token {diverge}"
        rows.append((chosen.label, report.resident, report.fp16_bytes, rate))
        print(f"== {chosen.label}: {report.resident / 1024:.0f} KiB cache "
              f"({100 * report.resident / max(report.fp16_bytes, 1):.1f}% of fp16), prefill {prefill_s:.2f} s, "
              f"{rate:.1f} tok/s, {where}")
        print(text.replace("\n", "\n   "))
        print()
    print(f"prompt {len(prompt)} tokens, {args.max_tokens} greedy tokens per scheme; "
          f"⟨≠⟩ marks the first token that differs from {rows[0][0]}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .measure.planner import choose, measure_plan, plan_markdown, sensitivity
    from .specs import read_scheme_spec

    scheme, options = read_scheme_spec(args.scheme)
    model, tokenizer = load_model(args.model)
    if tokenizer is None:
        raise ValueError(f"{args.model}: a plan reads the shipped passages, which needs the model's tokenizer "
                         "(teaching-llama, smollm2-135m, gemma3-270m or a folder with one)")
    sens = sensitivity(model, tokenizer, scheme, args.context, quantize_last=args.quantize_last,
                       quantize_sliding=args.quantize_sliding, progress=not args.quiet, **options)
    chosen = choose(sens, args.budget)
    if args.measure:
        chosen.report["measured"] = measure_plan(model, tokenizer, sens, chosen)
    if args.json:
        print(json.dumps(chosen.to_dict(), indent=1))
    else:
        print(plan_markdown(sens, chosen))
    if args.out:
        chosen.save(args.out)
        print(f"wrote {args.out}: gmlx_lab.make_cache(model, plan={args.out!r}), or gmlx-lab compare --plan "
              f"{args.out}", file=sys.stderr if args.json else sys.stdout)
    return 0


def budget_share(text: str) -> float:
    """A memory budget as a share of fp16's bytes: 0.5 or 50%."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share; accepted: 0.5 or 50%") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is outside (0, 1]; accepted: a share of fp16's bytes such as 0.5")
    return value


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import doctor, to_text

    report = doctor()
    print(json.dumps(report, indent=2) if args.json else to_text(report))
    failed = [k for k in report["kernels"] or [] if not k["passed"]]
    return 1 if failed else 0


def number_list(text: str, kind: type = int) -> list[Any]:
    """"1024,2048" -> [1024, 2048]; "0.1,0.5" with kind=float -> [0.1, 0.5]; a ValueError names a bad item."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            out.append(kind(part))
        except ValueError:
            raise ValueError(f"cannot read {part!r} in {text!r} as {kind.__name__}") from None
    if not out:
        raise ValueError("an empty list")
    return out


def cmd_passkey(args: argparse.Namespace) -> int:
    from .measure.experiments import passkey

    specs = scheme_list(args.schemes)
    lengths, depths = number_list(args.lengths), number_list(args.depths, float)
    model, tokenizer = load_model(args.model)
    if tokenizer is None:
        raise ValueError(f"{args.model}: passkey needs a model with a tokenizer")
    result = passkey(model, tokenizer, specs, lengths, depths, keys_per_cell=args.keys, digits=args.digits,
                     seed=args.seed, share_prefill=not args.own_prefill, progress=not args.quiet)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.to_markdown())
        print(f"({result.seconds:.1f} s)")
    return 0


def eval_prompts(tokenizer: Any, model: nn.Module, count: int, tokens: int) -> list[list[int]]:
    """`count` prompts of `tokens` ids from different places of the bundled evaluation text."""
    ids = encode(tokenizer, model, _read_text(None))
    stride = len(ids) // max(count, 1)
    if stride < tokens:
        raise ValueError(f"{count} prompts of {tokens} tokens do not fit in the evaluation text ({len(ids)} tokens)")
    return [ids[i * stride : i * stride + tokens] for i in range(count)]


def cmd_draft(args: argparse.Namespace) -> int:
    from .measure.experiments import draft_acceptance, layer_skip_draft

    specs = scheme_list(args.schemes)
    model, tokenizer = load_model(args.model)
    draft = layer_skip_draft(model, args.draft_layers)
    prompts = eval_prompts(tokenizer, model, args.prompts, args.prompt_tokens)
    result = draft_acceptance(model, tokenizer, draft, specs, prompts, num_draft_tokens=args.num_draft,
                              max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.to_markdown())
    return 0


def cmd_weights_kv(args: argparse.Namespace) -> int:
    from .measure.experiments import parse_weight_bits, weights_and_kv

    specs = scheme_list(args.schemes)
    bits = parse_weight_bits(args.weight_bits)
    model, tokenizer = load_model(args.model)
    tokens = encode(tokenizer, model, _read_text(args.text_file))
    result = weights_and_kv(model, tokens, bits, specs, prefill=args.prefill, decode=args.decode,
                            group_size=args.group_size, simulate=not args.real_quantized, progress=not args.quiet)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.to_markdown())
    return 0


def find_notebooks() -> Path:
    """The notebooks/ folder: in the current directory, or next to the package (a source checkout)."""
    for folder in (Path.cwd() / "notebooks", PACKAGE_DIR.parent / "notebooks"):
        if folder.is_dir():
            return folder
    raise FileNotFoundError("no notebooks/ folder here or next to the gmlx_lab package; "
                            "run `gmlx-lab lab` from the gmlx_lab repository")


def cmd_lab(args: argparse.Namespace) -> int:
    folder = find_notebooks()
    if importlib.util.find_spec("jupyterlab") is None:
        raise RuntimeError("jupyterlab is not installed; install it with: pip install 'gmlx-lab[lab]'")
    extra = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []  # containers, CI boxes
    return subprocess.call([sys.executable, "-m", "jupyterlab", str(folder), *extra, *args.jupyter_args])


def cmd_book(args: argparse.Namespace) -> int:
    """Run every notebook and write the static book (gmlx_lab.book)."""
    from .book import build

    executed = Path(args.executed) if args.executed else None
    pages = build(find_notebooks(), Path(args.out), executed, args.repo)
    print(f"[book] {len(pages)} pages: {Path(args.out) / 'index.html'}")
    return 0


def cmd_schemes(args: argparse.Namespace) -> int:
    """The scheme registry as a table: every scheme, option, default and accepted value."""
    from .registry import SCHEMES

    print("| scheme | option | default | accepted | meaning |\n|---|---|---|---|---|")
    for scheme in SCHEMES.values():
        print(f"| **{scheme.name}** | | | | {scheme.summary} |")
        for opt in scheme.options:
            print(f"| | {opt.name} | {opt.default} | {opt.accepted()} | {opt.help} |")
    return 0


def cmd_verdict(args: argparse.Namespace) -> int:
    """Which scheme when: the committed banded-fidelity results as recommendations per budget and context."""
    from .measure import verdict
    from .measure.speed import committed_speeds

    try:
        budgets = verdict.BUDGETS if args.budgets is None else tuple(float(b) for b in args.budgets.split(","))
    except ValueError:
        raise ValueError(f"--budgets takes shares of fp16's bytes like 0.8,0.6,0.4, got {args.budgets!r}") from None
    results = verdict.load_verdict(args.model, args.machine)
    recs = verdict.recommendations(results, budgets, speeds=committed_speeds())
    if args.json:
        print(json.dumps([recommendation_dict(r) for r in recs], indent=1))
        return 0
    print(verdict.recommendation_table(recs))
    print(f"\n{results.model}, {results.passages} passages, measured on the {', '.join(results.machines)}; "
          f"{results.method}\nfrom {results.path}\nThe quality floor: {verdict.floor_text()}; GPU b1: decode "
          "speed against mlx-lm's fp16 KVCache (gmlx_lab.measure.speed)")
    return 0


def recommendation_dict(rec: Any) -> dict[str, Any]:
    """One recommendation as JSON: the rows by spec, the sentence, the comparison and the speeds."""
    speeds = {}
    if rec.speeds is not None:
        speeds = {row.spec: {s.setting: {"ratio": s.ratio, "text": s.text()} for s in rec.speeds.of(row.label)}
                  for row in (rec.pick, rec.runner_up) if row is not None}
    return {"budget": rec.budget, "context": rec.context, "text": rec.text(),
            "recommended": rec.pick and rec.pick.spec, "runner_up": rec.runner_up and rec.runner_up.spec,
            "breaks": rec.broken and rec.broken.spec, "comparison": rec.comparison and rec.comparison.to_dict(),
            "speed": speeds}


def cmd_recommend(args: argparse.Namespace) -> int:
    """Your model: the rows that fit its cache under the budget, fidelity from the nearest measured model."""
    from .measure.advice import advise
    from .measure.speed import committed_speeds

    model, _ = load_model(args.model)
    advice = advise(model, args.context, args.budget, committed_speeds(), name=getattr(model, "gmlx_name", None))
    if args.json:
        print(json.dumps({**recommendation_dict(advice.recommendation), "model": advice.model,
                          "evidence": advice.evidence.model, "evidence_context": advice.evidence_context,
                          "fitting": advice.table(),
                          "plan_command": advice.plan_command(args.model or "teaching-llama")}, indent=1))
        return 0
    print(advice.text(args.model or "teaching-llama"))
    rows = advice.table()
    if rows:
        heads = list(rows[0])
        widths = [max(len(h), *(len(r[h]) for r in rows)) for h in heads]
        print()
        for line in [dict(zip(heads, heads))] + rows:
            print("  ".join(line[h].ljust(w) for h, w in zip(heads, widths)).rstrip())
    return 0


# -- parser -----------------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse with gmlx-lab's error format: one line, `gmlx-lab: error: ...`, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"gmlx-lab: error: {message} (`{self.prog} --help` lists the options)\n")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= minimum; argparse names the argument in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int; accepted: an int >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not accepted; accepted: an int >= {minimum}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `gmlx-lab` and its subcommands (every numeric argument is an int >= 1)."""
    parser = Parser(prog="gmlx-lab", description="Learn, see and measure KV-cache quantization.")
    count = int_at_least(1)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", default=None,
                       help="teaching-llama (default), smollm2-135m, gemma3-270m, a specimen family or a model folder")
    quiet = argparse.ArgumentParser(add_help=False)
    quiet.add_argument("--quiet", action="store_true", help="no progress bars")
    override = argparse.ArgumentParser(add_help=False)
    group = override.add_argument_group("policy overrides (exploration; default: gmlx's rule)")
    group.add_argument("--quantize-layers", default=None, metavar="5,11",
                       help="quantize only these layers (by cache index), the last or sliding ones too")
    group.add_argument("--fp16-layers", default=None, metavar="3", help="keep these layers fp16")
    group.add_argument("--quantize-last", action="store_true", help="also quantize the last layer of a deep stack")
    group.add_argument("--quantize-sliding", action="store_true",
                       help="also quantize sliding-window layers (rolling windows attended with the model's mask)")

    p = sub.add_parser("compare", parents=[model, override],
                       help="greedy generation under several schemes, side by side")
    p.add_argument("--schemes", default=COMPARE_SCHEMES, help=f"comma-separated specs (default {COMPARE_SCHEMES})")
    p.add_argument("--prompt", default=None, help="prompt text (default: the start of --prompt-file)")
    p.add_argument("--prompt-file", default=None, help="default: the bundled evaluation text")
    p.add_argument("--prompt-tokens", type=count, default=1500, help="tokens of --prompt-file used (default 1500)")
    p.add_argument("--max-tokens", type=count, default=40, help="greedy tokens per scheme (default 40)")
    p.add_argument("--max-kv-size", type=count, default=None,
                   help="rolling window: the attention layers keep this many tokens (sink + newest), quantized")
    p.add_argument("--plan", default=None, metavar="FILE", help="also generate under a plan (gmlx-lab plan --out)")
    p.set_defaults(run=cmd_compare)

    p = sub.add_parser("fidelity", parents=[model, quiet, override], help="teacher-forced KL against the fp16 cache")
    p.add_argument("--schemes", default=FIDELITY_SCHEMES, help=f"comma-separated specs (default {FIDELITY_SCHEMES})")
    p.add_argument("--sweep", default=None, choices=["widths", "tails", "split", "ladder", "layers"],
                   help="a named sweep instead of --schemes (layers: the first --schemes entry, one layer at a time)")
    p.add_argument("--prefill", type=count, default=1900, help="prefill tokens (default 1900)")
    p.add_argument("--decode", type=count, default=128, help="tokens decoded one at a time (default 128)")
    p.add_argument("--prefill-step", type=count, default=2048, help="prefill chunk size (default 2048)")
    p.add_argument("--text-file", default=None, help="default: the bundled evaluation text")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(run=cmd_fidelity)

    p = sub.add_parser("policy", parents=[override], help="the [kv] line and per-layer decisions for a model")
    p.add_argument("model_name", metavar="MODEL", nargs="?", default=None,
                   help="teaching-llama (default), a specimen family (llama, gpt_oss, ...), smollm2-135m, gemma3-270m "
                        "or a folder")
    p.add_argument("--schemes", default="kvarn,affine", help="comma-separated specs (default kvarn,affine)")
    p.add_argument("--json", action="store_true", help="print the kv_quant dicts as JSON")
    p.add_argument("--plan", default=None, metavar="FILE", help="the decisions of a plan instead of --schemes")
    p.set_defaults(run=cmd_policy)

    p = sub.add_parser("plan", parents=[model, quiet], help="per-layer widths under a memory budget, from each "
                       "layer's measured sensitivity")
    p.add_argument("--scheme", default="kvarn:tail=128",
                   help="the scheme and its options but the widths (default kvarn:tail=128)")
    p.add_argument("--budget", type=budget_share, default=0.5, help="a share of fp16's bytes (default 0.5)")
    p.add_argument("--context", type=count, default=2048, help="the context the budget holds at (default 2048)")
    p.add_argument("--quantize-last", action="store_true", help="the last layer of a deep stack is the plan's "
                   "to decide too")
    p.add_argument("--quantize-sliding", action="store_true", help="sliding-window layers are the plan's too")
    p.add_argument("--measure", action="store_true", help="also measure the plan against the widest uniform width "
                   "that fits the budget, on the passages the probes did not read (minutes more)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the plan as JSON (make_cache(plan=FILE))")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("memory", parents=[model, override], help="resident cache bytes per scheme, layer and region")
    p.add_argument("--context", type=count, default=4096, help="tokens in the cache (default 4096)")
    p.add_argument("--max-kv-size", type=count, default=None,
                   help="rolling window: the attention layers keep this many tokens (sink + newest), quantized")
    p.add_argument("--schemes", default=MEMORY_SCHEMES, help=f"comma-separated specs (default {MEMORY_SCHEMES})")
    p.add_argument("--layers", action="store_true", help="also print a per-layer table per scheme")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_memory)

    p = sub.add_parser("doctor", help="backend, versions, each kernel's self-check, BLAS")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_doctor)


    p = sub.add_parser("passkey", parents=[quiet], help="passkey retrieval per scheme over depths x lengths")
    p.add_argument("--model", default="gemma3-270m",
                   help="gemma3-270m (default: the bundled teaching-llama cannot retrieve a passkey), or another")
    p.add_argument("--schemes", default=PASSKEY_SCHEMES, help=f"comma-separated specs (default {PASSKEY_SCHEMES})")
    p.add_argument("--lengths", default="1024,2048", help="prompt lengths in tokens (default 1024,2048)")
    p.add_argument("--depths", default="0.1,0.5,0.9",
                   help="needle depths: share of the filler before the needle (default 0.1,0.5,0.9)")
    p.add_argument("--keys", type=int, default=1, help="random keys per cell (default 1)")
    p.add_argument("--digits", type=int, default=5, help="digits of the passkey (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--own-prefill", action="store_true",
                   help="prefill each scheme through its own cache (default: one fp16 prefill, stored by each scheme)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_passkey)

    p = sub.add_parser("draft", parents=[model], help="speculative decoding: draft acceptance per target cache scheme")
    p.add_argument("--schemes", default=DRAFT_SCHEMES, help=f"target cache specs (default {DRAFT_SCHEMES})")
    p.add_argument("--draft-layers", type=int, default=4,
                   help="the draft is the target's first N layers, sharing its weights (default 4; all layers: the "
                        "target itself with an fp16 cache)")
    p.add_argument("--prompts", type=int, default=2, help="prompts from the evaluation text (default 2)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt (default 512)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--num-draft", type=int, default=3, help="draft tokens per verify step (default 3)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_draft)

    p = sub.add_parser("weights-kv", parents=[model, quiet],
                       help="KL of quantized weights x KV schemes against fp16 weights with an fp16 cache")
    p.add_argument("--weight-bits", default="fp16,8,4,3", help="weight widths, fp16 for the model's own (default "
                                                                 "fp16,8,4,3)")
    p.add_argument("--schemes", default=WEIGHTS_KV_SCHEMES, help=f"KV specs (default {WEIGHTS_KV_SCHEMES})")
    p.add_argument("--prefill", type=int, default=1024, help="prefill tokens (default 1024)")
    p.add_argument("--decode", type=int, default=64, help="tokens decoded one at a time and scored (default 64)")
    p.add_argument("--group-size", type=int, default=64, help="weight quantization group size (default 64)")
    p.add_argument("--real-quantized", action="store_true",
                   help="run nn.quantize's quantized matmuls (default: the same dequantized weights in float "
                        "matmuls, several times faster on the CPU)")
    p.add_argument("--text-file", default=None, help="default: the bundled evaluation text")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_weights_kv)

    p = sub.add_parser("schemes", help="the scheme registry: options, defaults, accepted values")
    p.set_defaults(run=cmd_schemes)

    p = sub.add_parser("verdict", help="which scheme when: the best scheme per memory budget and context")
    p.add_argument("--model", default="gemma3-270m", help="a model with committed results (benchmarks/verdict.py)")
    p.add_argument("--machine", default=None,
                   help="the machine tag in the results file's name (cpu, h200); default: the file with the most "
                        "contexts")
    p.add_argument("--budgets", default=None, help="shares of fp16's bytes, comma-separated (default: "
                   "gmlx_lab.measure.verdict.BUDGETS)")
    p.add_argument("--json", action="store_true", help="the recommendations as JSON")
    p.set_defaults(run=cmd_verdict)

    p = sub.add_parser("recommend", parents=[model], help="which scheme for your model, context and budget: the "
                       "rows that fit its cache, with fidelity from the nearest measured model")
    p.add_argument("--context", type=count, default=4096, help="tokens in the cache (default 4096)")
    p.add_argument("--budget", type=budget_share, default=0.5, help="a share of fp16's bytes: 0.5 or 50%% "
                   "(default 0.5)")
    p.add_argument("--json", action="store_true", help="the answer as JSON")
    p.set_defaults(run=cmd_recommend)

    p = sub.add_parser("lab", help="start JupyterLab on the notebooks/ folder")
    p.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="passed on to jupyter lab")
    p.set_defaults(run=cmd_lab)

    p = sub.add_parser("book", help="run every notebook and write a static site of them (build/book/index.html)")
    p.add_argument("--out", default="build/book", help="the site's folder (default: build/book)")
    p.add_argument("--executed", default=None, metavar="DIR",
                   help="render the notebooks already executed in DIR instead of running them")
    p.add_argument("--repo", default=None, metavar="OWNER/NAME",
                   help="GitHub repository for the Binder links (default: the checkout's origin remote)")
    p.set_defaults(run=cmd_book)

    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE (a module name or a .py file) first: it registers its schemes; repeatable")
    return parser


def _fail(exc: BaseException, code: int) -> int:
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"gmlx-lab: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run `gmlx-lab`; returns the exit code (2: bad input, 1: failure)."""
    args = build_parser().parse_args(argv)
    try:
        for name in args.plugin:
            load_plugin(name)
        return args.run(args)
    except BrokenPipeError:  # output piped into `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ValueError as exc:
        return _fail(exc, 2)
    except (RuntimeError, AssertionError, OSError) as exc:  # ModelNotAvailableError is a RuntimeError
        return _fail(exc, 1)
    except KeyboardInterrupt:
        print("gmlx-lab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
