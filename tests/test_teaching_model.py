"""The bundled teaching model loads offline with mlx-lm, has the promised shape, and speaks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402
from mlx_lm import generate, load  # noqa: E402

import gmlx_lab  # noqa: E402
from gmlx_lab.measure.metrics import perplexity  # noqa: E402

MODEL_DIR = Path(gmlx_lab.__file__).parent / "models" / "teaching_llama"
EVAL_TEXT = Path(gmlx_lab.__file__).parent / "data" / "eval_text.txt"


@pytest.fixture(scope="module")
def loaded() -> tuple[Any, Any]:
    """The model in float32 (fast on the CPU) and its tokenizer."""
    model, tokenizer = load(str(MODEL_DIR))
    model.set_dtype(mx.float32)
    return model, tokenizer


@pytest.fixture(scope="module")
def log() -> dict[str, Any]:
    """training_log.json of the bundled model."""
    return json.loads((MODEL_DIR / "training_log.json").read_text())


def test_config_is_small_gqa_llama() -> None:
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["head_dim"] == 128
    assert cfg["num_hidden_layers"] >= 8
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert cfg["rope_theta"] == 10000.0  # top level: mlx-lm ignores rope_parameters
    assert cfg["bos_token_id"] == 0 and cfg["eos_token_id"] == 1
    weights = mx.load(str(MODEL_DIR / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {mx.float16}
    n_params = sum(w.size for w in weights.values())
    assert 10_000_000 <= n_params <= 30_000_000


def test_tokenizer_adds_bos(loaded: tuple[Any, Any]) -> None:
    _, tokenizer = loaded
    ids = tokenizer.encode("ROMEO:")
    assert ids[0] == tokenizer.bos_token_id == 0
    assert tokenizer.decode(ids[1:]) == "ROMEO:"


def test_generates_recognisable_text(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    text = generate(model, tokenizer, prompt="ROMEO:", max_tokens=48)
    words = [w for w in text.split() if w.isalpha()]
    assert len(text.strip()) > 40, text
    assert len(set(words)) >= 6, text
    assert sum(c.isalpha() or c.isspace() for c in text) / len(text) > 0.8, text


def test_eval_text_perplexity_matches_log(loaded: tuple[Any, Any], log: dict[str, Any]) -> None:
    model, tokenizer = loaded
    ids = tokenizer.encode(EVAL_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    ppl = perplexity(model, ids, window=512, max_tokens=2048, bos_id=tokenizer.bos_token_id)
    assert ppl == pytest.approx(log["eval_text_perplexity_mlx"], rel=0.05)
    assert ppl == pytest.approx(log["eval_text_perplexity"], rel=0.05)  # torch, same protocol
    assert ppl < 100
