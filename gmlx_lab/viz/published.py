"""Data the notebooks show beside their own measurements: published figures, family sizes, benchmark files.

Published figures are quoted with their source; nothing here is measured by us.
"""

from __future__ import annotations

import json
from typing import Any

from ..measure.sizes import layer_shapes, policy_bytes
from ..models import FAMILIES, specimen
from ..paths import RESULTS_DIR
from ..policy import policy
from ..registry import BASELINE

GMLX_KL_TABLE = {
    "source": "gmlx documentation, KV cache fidelity (docs/kvarn-spec.md section 5): Qwen3.8-27B, 16K context, "
              "decode median KL in nats",
    "rows": [
        {"bits": 2, "affine": 0.02314, "kvarn": 0.00491},
        {"bits": 4, "affine": 0.00136, "kvarn": 0.00045},
        {"bits": 6, "affine": 0.00030, "kvarn": 0.00019},
        {"bits": 8, "affine": 0.00019, "kvarn": 0.00015},
    ],
}

LLAMA_CPP_ROTATION_PPL = {
    "source": "llama.cpp PR #21038 (attention rotation), WikiText perplexity of base models, "
              "as collected in the seed 'KV cache quantization tradeoffs on Apple GPUs'",
    "rows": [
        {"model": "Qwen3 8B", "cache": "q4_0", "f16": 7.3203, "before rotation": 7.6451, "after rotation": 7.5012},
        {"model": "Qwen3 8B", "cache": "q8_0", "f16": 7.3203, "before rotation": 7.3172, "after rotation": 7.3195},
        {"model": "Gemma3 4B", "cache": "q4_0", "f16": 7.6905, "before rotation": 7.8535, "after rotation": 7.7928},
        {"model": "Qwen3 0.6B", "cache": "q4_0", "f16": 13.6711, "before rotation": 62.02, "after rotation": 46.25},
        {"model": "Qwen3 0.6B", "cache": "q4_1", "f16": 13.6711, "before rotation": 212.5, "after rotation": 22.28},
    ],
}

# Real models with full attention on every layer: (layers, KV heads, head_dim) from their published configs.
REAL_DENSE_CONFIGS = {
    "Llama-3.1-8B": (32, 8, 128),
    "Qwen3-32B": (64, 8, 128),
}


def dense_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_value: float = 2.0) -> float:
    """Cache bytes one token adds to a model with full attention on every layer: layers * 2 * heads * dim * bytes."""
    return layers * 2 * kv_heads * head_dim * bytes_per_value


def family_curves(contexts: list[int], scheme: str = BASELINE, **options: Any) -> dict[str, dict[str, Any]]:
    """For each specimen family: the policy under `scheme` and its cache bytes at each context."""
    out = {}
    for name in FAMILIES:
        pol = policy(specimen(name), scheme, **options)
        shapes = layer_shapes(pol)
        out[name] = {"policy": pol, "bytes": [policy_bytes(pol, c, shapes) for c in contexts]}
    return out


def benchmark_results(pattern: str = "*.json") -> dict[str, Any]:
    """The committed JSON results (benchmarks/results/, shipped with the package) matching `pattern`, by file name
    (empty if none)."""
    if not RESULTS_DIR.is_dir():
        return {}
    found = {}
    for path in sorted(RESULTS_DIR.glob(pattern)):
        try:
            found[path.name] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            found[path.name] = {"error": f"could not read: {exc}"}
    return found
