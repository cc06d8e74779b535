"""Measure K outlier channels and attention sinks of the bundled teaching model (MLX, CPU ok).

Runs one prompt of ``--context`` tokens of ``gmlx_lab/data/eval_text.txt`` through the model
layer by layer and reports, per layer:

* K outliers: per-channel max |K| over tokens, before and after RoPE, as the ratio of the largest
  channel to the median channel (the quantity that makes per-token K quantization hard);
* attention sinks: mean attention mass that queries (positions >= 16) put on token 0 and on the
  first 4 tokens, averaged over heads, next to what uniform attention would give.

Both with the prompt starting with ``<s>`` and without it (a window cut from mid-text), so a sink
can be told apart from a BOS effect. Usage: ``python tools/inspect_teaching_model.py [--json out]``.

``--record-ppl`` (step 3 of rebuilding the model, after training) measures the eval-text
perplexity with MLX by the training log's protocol and stores it in ``training_log.json`` as
``eval_text_perplexity_mlx``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MIN_QUERY = 16


def causal_attention_probs(q: mx.array, k: mx.array, scale: float) -> mx.array:
    """Softmax(q k^T * scale) with a causal mask; q (H, T, D), k (H_kv, T, D) -> (H, T, T)."""
    rep = q.shape[0] // k.shape[0]
    k = mx.repeat(k, rep, axis=0)
    scores = (q @ k.transpose(0, 2, 1)) * scale
    t = q.shape[1]
    mask = mx.triu(mx.full((t, t), -mx.inf), k=1)
    return mx.softmax(scores + mask, axis=-1)


def channel_ratio(x: mx.array) -> dict[str, Any]:
    """Per-channel max |x| over tokens for x (T, D): top/median ratio and the top channels."""
    m = np.asarray(mx.max(mx.abs(x), axis=0))
    order = np.argsort(-m)
    return {"top_over_median": float(m[order[0]] / np.median(m)), "top_channels": order[:3].tolist(),
            "top_values": [round(float(v), 2) for v in m[order[:3]]], "median": round(float(np.median(m)), 3)}


def inspect(model: Any, ids: list[int]) -> list[dict[str, Any]]:
    """Per-layer K-outlier and attention-sink statistics for one prompt of token ids."""
    x = model.model.embed_tokens(mx.array(ids)[None])
    t = len(ids)
    pos = np.arange(MIN_QUERY, t)
    uniform0 = float(np.mean(1.0 / (pos + 1)))
    uniform4 = float(np.mean(4.0 / (pos + 1)))
    rows = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).reshape(1, t, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = attn.k_proj(h).reshape(1, t, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        k_pre = k[0, 0]
        q, k = attn.rope(q), attn.rope(k)
        probs = causal_attention_probs(q[0], k[0], attn.scale)[:, MIN_QUERY:, :]
        mass0 = float(mx.mean(probs[:, :, 0]))
        mass4 = float(mx.mean(mx.sum(probs[:, :, :4], axis=-1)))
        per_head0 = [round(float(v), 3) for v in mx.mean(probs[:, :, 0], axis=1)]
        rows.append({
            "layer": i,
            "k_pre_rope": channel_ratio(k_pre),
            "k_post_rope": channel_ratio(k[0, 0]),
            "attn_mass_token0": round(mass0, 4),
            "attn_mass_first4": round(mass4, 4),
            "attn_mass_token0_per_head": per_head0,
            "uniform_token0": round(uniform0, 4),
            "uniform_first4": round(uniform4, 4),
        })
        x = layer(x, mask="causal")
        mx.eval(x)
    return rows


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    """Print one compact table of the measurements."""
    print(f"\n{title}")
    print("layer  K/med pre-RoPE (top ch)  K/med post-RoPE  mass tok0 (heads)          mass first4")
    for r in rows:
        pre, post = r["k_pre_rope"], r["k_post_rope"]
        heads = r["attn_mass_token0_per_head"]
        print(f"{r['layer']:>5}  {pre['top_over_median']:>8.2f} ({pre['top_channels'][0]:>3})"
              f"           {post['top_over_median']:>6.2f}  {r['attn_mass_token0']:.3f} {heads}"
              f"  {r['attn_mass_first4']:.3f}")
    u0, u4 = rows[0]["uniform_token0"], rows[0]["uniform_first4"]
    print(f"uniform attention would give token0 {u0:.3f}, first4 {u4:.3f}")


def record_perplexity(model: Any, tok: Any, folder: Path, text: str) -> float:
    """Measure the eval-text perplexity with MLX (window 512, first 2048 tokens) and log it."""
    from gmlx_lab.measure.metrics import perplexity

    ids = tok.encode(text, add_special_tokens=False)
    ppl = perplexity(model, ids, window=512, max_tokens=2048, bos_id=tok.bos_token_id)
    log_path = folder / "training_log.json"
    log = json.loads(log_path.read_text())
    log["eval_text_perplexity_mlx"] = round(ppl, 4)
    log["eval_text_perplexity_mlx_protocol"] = (
        "gmlx_lab.measure.metrics.perplexity(model, ids, window=512, max_tokens=2048, bos_id=<s>) with mlx-lm on the "
        "CPU, weights as shipped (fp16) cast to float32; ids = eval_text.txt tokenized without special tokens"
    )
    log_path.write_text(json.dumps(log, indent=2) + "\n")
    return ppl


def main(argv: list[str] | None = None) -> None:
    """Load the model with mlx-lm and print (and optionally save) the measurements."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "gmlx_lab" / "models" / "teaching_llama")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--record-ppl", action="store_true", help="write eval_text_perplexity_mlx into the log")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from mlx_lm import load

    model, tok = load(str(args.model))
    model.set_dtype(mx.float32)
    text = (ROOT / "gmlx_lab" / "data" / "eval_text.txt").read_text(encoding="utf-8")
    if args.record_ppl:
        print(f"eval-text perplexity (MLX): {record_perplexity(model, tok, args.model, text):.4f}")
    ids = tok.encode(text, add_special_tokens=False)
    out = {
        "context": args.context,
        "with_bos": inspect(model, [tok.bos_token_id, *ids[: args.context - 1]]),
        "without_bos_mid_text": inspect(model, ids[1000 : 1000 + args.context]),
    }
    print_table(f"prompt = <s> + first {args.context - 1} eval-text tokens", out["with_bos"])
    print_table(f"prompt = eval-text tokens 1000..{1000 + args.context} (no <s>)", out["without_bos_mid_text"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
