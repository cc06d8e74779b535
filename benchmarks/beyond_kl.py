"""Beyond KL at full size: passkey retrieval, draft acceptance, KV on quantized weights (issue 17).

    python benchmarks/beyond_kl.py --model gemma3-270m        # -> results/beyond-kl-gemma3-270m-cpu.json
    python benchmarks/beyond_kl.py --model teaching-llama     # -> results/beyond-kl-teaching-llama-cpu.json
    python benchmarks/beyond_kl.py --model gemma3-270m --sections weights_kv   # one section, the others kept

Each model has a preset (PRESETS): the sizes chosen so that both models together run in about 25 minutes
on a 2-core CPU. Sections are written into the JSON as they finish; running a section again replaces
only that section. Each section stores its method, its sizes, its seconds and its result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from gmlx_lab.cli import eval_prompts, load_model
from gmlx_lab.doctor import machine_tag
from gmlx_lab.kv_inspect import EVAL_TEXT
from gmlx_lab.measure.experiments import (
    draft_acceptance,
    layer_skip_draft,
    passkey,
    weights_and_kv,
)

RESULTS = Path(__file__).resolve().parent / "results"

PRESETS: dict[str, dict[str, Any]] = {
    "gemma3-270m": {
        "passkey": {"schemes": ["fp16", "affine2", "affine3", "affine4", "kvarn2:tail=0", "kvarn2:tail=128",
                                "kvarn3:tail=0"],
                    "lengths": [768, 1536], "depths": [0.1, 0.4, 0.7], "keys_per_cell": 1},
        # more keys where it is decided: past the 512-token window, in kvarn's records, the borderline widths
        "passkey_far": {"schemes": ["fp16", "affine3", "affine4", "kvarn2:tail=0", "kvarn3:tail=0"],
                        "lengths": [1536], "depths": [0.15, 0.25, 0.35], "keys_per_cell": 1, "seed": 1},
        # the shared fp16 prefill against each scheme's own prefill, on a few cells
        "passkey_own_prefill": {"schemes": ["affine2", "kvarn2:tail=0"], "lengths": [768], "depths": [0.1, 0.4],
                                "keys_per_cell": 1},
        "weights_kv": {"weight_bits": [None, 8, 4, 3], "kv_schemes": ["fp16", "affine4", "kvarn4:tail=0"],
                       "prefill": 384, "decode": 32},
    },
    "teaching-llama": {
        # can the bundled model retrieve at all? (fp16 only)
        "passkey": {"schemes": ["fp16"], "lengths": [256, 512, 1024], "depths": [0.1, 0.5, 0.9],
                    "keys_per_cell": 1},
        "draft": {"schemes": ["fp16", "affine2", "affine4", "kvarn2:tail=0", "kvarn4:tail=0", "kvarn4:tail=128"],
                  "draft_layers": [4, 8], "prompts": 3, "prompt_tokens": 512, "max_tokens": 96,
                  "num_draft_tokens": 3},
        "weights_kv": {"weight_bits": [None, 8, 4, 3],
                       "kv_schemes": ["fp16", "affine3", "affine4", "kvarn3:tail=0", "kvarn4:tail=0"],
                       "prefill": 1024, "decode": 96},
    },
}

METHODS = {
    "passkey": ("A 5-digit random key in a needle sentence ('The pass key is K. Remember it. K is the pass key.') "
                "between repeated filler units ('The grass is green. ...'), after an intro; the needle after the "
                "share `depth` of the filler units. The context is prefilled once through fp16 caches and each "
                "scheme stores those K/V as one update, then seals (for kvarn exactly what a one-chunk prefill "
                "through its own cache stores); the question ('What is the pass key? The pass key is') arrives "
                "as one update and 7 tokens are decoded greedily. Correct: the first run of digits in the answer "
                "is the key. The model's own per-layer policy applies."),
    "passkey_far": "As passkey (other random keys: seed 1), on keys 900-1300 tokens before the question.",
    "passkey_own_prefill": ("As passkey, but each scheme prefills the context through its own cache (one chunk of "
                            "up to 2048 tokens), so affine's deeper layers also see its error during the prefill."),
    "draft": ("Greedy speculative decoding with mlx-lm's speculative_generate_step. The draft is the target's own "
              "embedding, first N layers and final norm/head (gmlx_lab.measure.experiments.layer_skip_draft: shared "
              "weights, no training) with an fp16 cache; N = all layers is the target itself with an fp16 cache, "
              "so its acceptance is the share of steps where the quantized-cache target agrees with fp16. Prompts "
              "from the bundled evaluation text. acceptance = accepted / drafted; tokens per step = tokens / "
              "target forward passes."),
    "weights_kv": ("Weights quantized as nn.quantize does (Linear and Embedding, group 64), simulated: each weight "
                   "replaced by mx.dequantize(mx.quantize(w)), the values a QuantizedLinear multiplies with, in "
                   "float32 matmuls (MLX's CPU quantized matmul is about 8x slower in prefill here). Every "
                   "(weights, KV) pair is scored against ONE reference, fp16 weights with an fp16 cache: "
                   "teacher-forced on the evaluation text, prefill unscored, then each decode token one at a time "
                   "through the cache; KL(reference || pair) in nats per decode token. compounding = mean KL of "
                   "the pair / (mean KL weights alone + mean KL KV alone)."),
}


def machine() -> dict[str, Any]:
    """Where the numbers were measured."""
    return {"device": "cpu", "platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
            "python": platform.python_version(), "mlx": version("mlx"), "mlx_lm": version("mlx-lm"),
            "blas_preload": os.environ.get("LD_PRELOAD", "")}


def run_section(name: str, cfg: dict[str, Any], model: Any, tokenizer: Any) -> dict[str, Any]:
    """One section: its result as a dict, with a markdown table."""
    if name.startswith("passkey"):
        result = passkey(model, tokenizer, cfg["schemes"], cfg["lengths"], cfg["depths"],
                         keys_per_cell=cfg["keys_per_cell"], seed=cfg.get("seed", 0),
                         share_prefill=name != "passkey_own_prefill", progress=True)
        return {"result": result.to_dict(), "markdown": result.to_markdown()}
    if name == "draft":
        prompts = eval_prompts(tokenizer, model, cfg["prompts"], cfg["prompt_tokens"])
        runs = []
        for n in cfg["draft_layers"]:
            result = draft_acceptance(model, tokenizer, layer_skip_draft(model, n), cfg["schemes"], prompts,
                                      num_draft_tokens=cfg["num_draft_tokens"], max_tokens=cfg["max_tokens"])
            print(result.to_markdown(), flush=True)
            runs.append({"draft_layers": n, "result": result.to_dict(), "markdown": result.to_markdown()})
        return {"drafts": runs}
    if name == "weights_kv":
        tokens = list(tokenizer.encode(EVAL_TEXT.read_text(encoding="utf-8")))
        result = weights_and_kv(model, tokens, cfg["weight_bits"], cfg["kv_schemes"], prefill=cfg["prefill"],
                                decode=cfg["decode"], progress=True)
        return {"result": result.to_dict(), "markdown": result.to_markdown()}
    raise ValueError(f"unknown section {name!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3-270m", choices=sorted(PRESETS))
    parser.add_argument("--sections", default="", help="comma-separated sections of the preset (default: all)")
    parser.add_argument("--out", default=None,
                        help="file under benchmarks/results/ (default: beyond-kl-MODEL-MACHINE.json)")
    args = parser.parse_args(argv)
    preset = PRESETS[args.model]
    sections = [s for s in args.sections.split(",") if s] or list(preset)
    unknown = [s for s in sections if s not in preset]
    if unknown:
        parser.error(f"{args.model} has no section {unknown}; it has {', '.join(preset)}")
    out = RESULTS / (args.out or f"beyond-kl-{args.model}-{machine_tag()}.json")
    data = json.loads(out.read_text()) if out.is_file() else {"model": args.model, "sections": {}}
    model, tokenizer = load_model(args.model)
    for name in sections:
        where = machine()
        start = time.perf_counter()
        body = run_section(name, preset[name], model, tokenizer)
        seconds = time.perf_counter() - start
        where["load_average_after"] = os.getloadavg()  # the machine is shared: 1, 5 and 15-minute load, ours included
        data["sections"][name] = {
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": where, "method": METHODS[name], "sizes": preset[name], "seconds": round(seconds, 1),
            **body}
        RESULTS.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(body.get("markdown", ""))
        print(f"{name}: {seconds:.0f} s, written to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
