"""Specimens: tiny random-weight mlx-lm models, one per cache family.

Each specimen is a real mlx-lm model class built from a tiny config, so
`model.make_cache()` (and `mlx_lm.models.cache.make_prompt_cache(model)`) gives
the family's real cache layout: `KVCache` for full attention, `RotatingKVCache`
for sliding windows, `ArraysCache` for recurrent layers, a latent `KVCache` for
MLA. Widths are tiny but head dims are the real ones, because head dim decides
what the KV policy may do. The weights are random (seeded): specimens show
cache shapes and policy decisions, not language.

Choices worth knowing:
- at least 4 layers, so the "last entry of a stack of more than 2 stays fp16"
  rule shows; the hybrids have 8 so one attention layer is not the last;
- sliding windows are 128 tokens (gpt-oss's real window; Gemma's real 512 or
  1024 is shortened) so a CPU demo can fill one;
- vocabularies have 512 ids and there is no tokenizer: feed token ids.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

VOCAB = 512
WINDOW = 128


@dataclass(frozen=True)
class Family:
    """One cache family: a specimen name, what it shows, and the tiny mlx-lm config."""

    name: str
    description: str
    real_world: str  # model families of the gmlx table that share this cache shape
    config: dict[str, Any] = field(repr=False)

    @property
    def model_type(self) -> str:
        """The mlx-lm module (mlx_lm.models.<model_type>) that builds the specimen."""
        return self.config["model_type"]


def _dense(**overrides: Any) -> dict[str, Any]:
    """Common tiny widths: hidden 256, FFN 512, vocab 512."""
    return {"hidden_size": 256, "intermediate_size": 512, "vocab_size": VOCAB,
            "rms_norm_eps": 1e-6, **overrides}


def _mla(**overrides: Any) -> dict[str, Any]:
    """DeepSeek-V3-style MLA with its real latent widths (512 latent + 64 RoPE dims), tiny MoE."""
    return _dense(
        model_type="deepseek_v3", num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=128, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, moe_intermediate_size=128,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, max_position_embeddings=4096, **overrides,
    )


_QWEN_LINEAR = {
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
}

_FAMILY_LIST = [
    Family(
        "llama",
        "full attention on every layer: every cache grows with the context (head_dim 128)",
        "Llama, Mistral, dense Qwen3",
        _dense(model_type="llama", num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=128, rope_theta=500000.0,
               tie_word_embeddings=True),
    ),
    Family(
        "qwen3_5",
        "recurrent hybrid: gated-delta ArraysCache on 3 layers of 4, full attention on the 4th (head_dim 256)",
        "Qwen3.5, Qwen3.6, Qwen3.8",
        {"model_type": "qwen3_5", "text_config": _dense(
            model_type="qwen3_5_text", num_hidden_layers=8, num_attention_heads=2,
            num_key_value_heads=1, head_dim=256, **_QWEN_LINEAR)},
    ),
    Family(
        "qwen3_next",
        "recurrent hybrid with MoE: ArraysCache on 3 layers of 4, full attention on the 4th (head_dim 256)",
        "Qwen3-Next (the Qwen3.5 predecessor)",
        _dense(model_type="qwen3_next", num_hidden_layers=8, num_attention_heads=2,
               num_key_value_heads=1, head_dim=256, rope_theta=10000000.0,
               partial_rotary_factor=0.25, max_position_embeddings=4096, num_experts=4,
               num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
               moe_intermediate_size=128, shared_expert_intermediate_size=128,
               **_QWEN_LINEAR),
    ),
    Family(
        "gemma3",
        "sliding-window mix: 5 RotatingKVCache window layers per global KVCache layer (head_dim 256)",
        "Gemma 3",
        _dense(model_type="gemma3_text", num_hidden_layers=12, num_attention_heads=2,
               num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
               sliding_window=WINDOW, sliding_window_pattern=6),
    ),
    Family(
        "gemma4",
        "sliding-window mix: 4 window layers (head_dim 256) per global layer (head_dim 512); "
        "the last layers reuse earlier caches",
        "gemma-4",
        _dense(model_type="gemma4_text", num_hidden_layers=12, num_attention_heads=2,
               num_key_value_heads=1, num_global_key_value_heads=1, head_dim=256,
               global_head_dim=512, num_kv_shared_layers=2, hidden_size_per_layer_input=64,
               vocab_size_per_layer_input=VOCAB, sliding_window=WINDOW,
               sliding_window_pattern=5),
    ),
    Family(
        "gpt_oss",
        "head_dim 64, alternating sliding-window and full-attention layers, MoE",
        "gpt-oss",
        _dense(model_type="gpt_oss", num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, intermediate_size=256,
               num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    ),
    Family(
        "deepseek_v3",
        "MLA latent cache: one shared 512-wide latent (keys) + 64 RoPE dims (values) per token",
        "DeepSeek-V3 (MLA, like DeepSeek-V4 and GLM-5.3)",
        _mla(),
    ),
    Family(
        "kimi_k2",
        "MLA latent cache, the DeepSeek-V3 architecture under Kimi K2.5's model type",
        "Kimi K2 and K3",
        {"model_type": "kimi_k25", "text_config": _mla()},
    ),
    Family(
        "kimi_linear",
        "hybrid of Kimi delta attention (ArraysCache, 3 layers of 4) and MLA latent layers",
        "Kimi Linear",
        _dense(model_type="kimi_linear", num_hidden_layers=8, num_attention_heads=2,
               num_key_value_heads=2, head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64,
               qk_nope_head_dim=128, v_head_dim=128, mla_use_nope=True, rope_theta=10000.0,
               model_max_length=4096, num_experts=4, num_experts_per_token=2,
               num_shared_experts=1, moe_intermediate_size=128, first_k_dense_replace=1,
               linear_attn_config={"kda_layers": [1, 2, 3, 5, 6, 7],
                                   "full_attn_layers": [4, 8],
                                   "num_heads": 2, "head_dim": 128,
                                   "short_conv_kernel_size": 4}),
    ),
]

FAMILIES: dict[str, Family] = {f.name: f for f in _FAMILY_LIST}


def families() -> list[Family]:
    """All specimen families, in teaching order (dense, hybrid, window, head_dim 64, MLA)."""
    return list(_FAMILY_LIST)


def specimen(family: str, seed: int = 0) -> nn.Module:
    """Build the tiny random-weight model of `family` (see FAMILIES), deterministically from `seed`.

    The model gets a `gmlx_name` attribute, e.g. "gemma3-specimen".
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    config = copy.deepcopy(FAMILIES[family].config)  # some ModelArgs edit nested dicts
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)  # nn layers draw their initial weights from MLX's global generator
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    model.gmlx_name = f"{family}-specimen"
    return model
