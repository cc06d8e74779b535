"""Shared fixtures: a tiny random-weight mlx-lm llama with head_dim 128 (no download), Gemma 3 270M once per session."""

import time

import mlx.core as mx
import pytest
from mlx_lm.models import llama

import gmlx_lab  # noqa: F401  (installs the attention hook and registers the caches)
from gmlx_lab import models
from gmlx_lab.kernels import active_backend, threads
from gmlx_lab.models import gemma3

_on_threads: dict[str, list[str]] = {source: [] for source in threads.SOURCES}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Without an MLX GPU backend each `gpu` test runs twice on CPU threads (one per lane,
    gmlx_lab/kernels/threads.py): from the kernels' CUDA sources and from their Metal sources, as
    mx.fast.metal_kernel generates them. The kernels' logic is tested, a GPU is not, and the summary says so."""
    if active_backend() == "cpu" and metafunc.definition.get_closest_marker("gpu"):
        metafunc.parametrize("kernel_source", threads.SOURCES)


@pytest.fixture
def kernel_source() -> str | None:
    """The source a `gpu` test's kernels run from on CPU threads (parametrized there); None elsewhere."""
    return None


@pytest.fixture(autouse=True)
def _kernels_on_cpu_threads(request: pytest.FixtureRequest, kernel_source: str | None):
    if kernel_source is not None:
        _on_threads[kernel_source].append(request.node.nodeid)
        with threads.on_cpu_threads(kernel_source):
            yield
    else:
        yield


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if any(_on_threads.values()):
        cuda, metal = (len(_on_threads[source]) for source in ("cuda", "metal"))
        terminalreporter.write_line(
            f"ON CPU THREADS, NOT A GPU: {cuda} GPU kernel tests ran the kernels' CUDA sources and {metal} their Metal "
            "sources (as mx.fast.metal_kernel generates them) on CPU threads (gmlx_lab/kernels/threads.py) because "
            "MLX runs on the CPU here; their H200 logs are in benchmarks/results/gpu-tests-h200/"
        )


def tiny_llama(layers: int = 4, head_dim: int = 128, seed: int = 0) -> llama.Model:
    """A small llama with real mlx-lm classes and random weights."""
    args = llama.ModelArgs(
        model_type="llama", hidden_size=256, num_hidden_layers=layers, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-5,
        vocab_size=300, rope_theta=10000.0, tie_word_embeddings=True,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def model() -> llama.Model:
    return tiny_llama()


def occurrences(node, marker: str) -> int:
    """How often `marker` occurs in the strings of a nested dict/list (a notebook, its outputs, its widget state)."""
    if isinstance(node, str):
        return node.count(marker)
    if isinstance(node, dict):
        return sum(occurrences(v, marker) for v in node.values())
    if isinstance(node, list):
        return sum(occurrences(v, marker) for v in node)
    return 0


def random_kv(tokens: int, heads: int = 2, dim: int = 128, seed: int = 0) -> tuple[mx.array, mx.array]:
    """Random K/V with a few outlier channels in K, as real models have."""
    mx.random.seed(seed)
    k = mx.random.normal((1, heads, tokens, dim))
    k = k * mx.where(mx.arange(dim) % 37 == 3, 20.0, 1.0)
    v = mx.random.normal((1, heads, tokens, dim))
    return k, v


@pytest.fixture(scope="session")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Convert gemma3-270m from its PyPI GGUF into a fresh cache and load it (float32), once per session."""
    if not gemma3.gguf_available():
        pytest.fail(f"gemma3-270m needs its PyPI packages: {gemma3.INSTALL_COMMAND}")
    cache = tmp_path_factory.mktemp("gmlx_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GMLX_LAB_CACHE", str(cache))
        before = {m.name: m for m in models.available_models()}["gemma3-270m"]
        start = time.perf_counter()
        folder = gemma3.ensure_converted()
        seconds = time.perf_counter() - start
        model, tokenizer = models.load("gemma3-270m", compute_dtype=mx.float32)
        after = {m.name: m for m in models.available_models()}["gemma3-270m"]
    print(f"\n[gemma3-270m] converted in {seconds:.1f} s")
    return {"model": model, "tokenizer": tokenizer, "folder": folder, "cache": cache, "before": before,
            "after": after}
