"""The CUDA kernel disk cache (gmlx_lab/kernels/precompiled.py): the text NVRTC gets, where binaries are kept,
and how launches fall back to mx.fast.cuda_kernel, loudly, when no binary can be had. NVRTC and the GPU are
stood in for here (a recording compiler, a recording launch); benchmarks/gpu_check.sh runs the real ones."""

import warnings

import mlx.core as mx
import pytest
from conftest import tiny_llama

import gmlx_lab
from gmlx_lab.kernels import build, config, precompiled
from gmlx_lab.kernels.sources import assemble, compact

INPUTS = (("records", mx.uint32), ("params", mx.int32), ("q", mx.float16))
OUTPUTS = (("out", mx.float16), ("lse", mx.float32))
TEMPLATE = (("B", 4), ("KIND_K", 1), ("S", 1), ("ROTATE", 0), ("ODT", 1))
FAKE_CUBIN = precompiled.ELF_MAGIC + b"cubin"


class FakeNvrtc:
    """Stands in for NVRTC: counts compiles and returns a marked binary (or raises, to act as a compile error)."""

    version = "13.0"

    def __init__(self, error: str | None = None):
        self.texts: list[str] = []
        self.error = error

    def compile(self, text: str, arch: str, filename: str) -> bytes:
        self.texts.append(text)
        if self.error:
            raise RuntimeError(self.error)
        return FAKE_CUBIN + arch.encode()


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache folder, no binaries or fallbacks remembered, an H200's arch, and a stand-in NVRTC."""
    monkeypatch.setenv("GMLX_KERNEL_CACHE_DIR", str(tmp_path))
    fake = FakeNvrtc()
    monkeypatch.setattr(precompiled, "nvrtc", lambda: fake)
    monkeypatch.setattr(precompiled, "device_arch", lambda: "sm_90a")
    precompiled.forget()
    yield fake
    precompiled.forget()


def test_kernel_text_is_the_kernels_header_and_body_in_mlxs_signature():
    text = precompiled.kernel_text("gmlx_kvarn_unpack_x", "kvarn_unpack", INPUTS, OUTPUTS, dict(TEMPLATE))
    header, body = (compact(t) for t in assemble("kvarn_unpack", "cuda"))
    signature = ('extern "C" __global__ void gmlx_kvarn_unpack_x(\n    const unsigned int* records,\n'
                 '    const int* params,\n    const __half* q,\n    __half* out,\n    float* lse) {\n'
                 '  constexpr int B = 4;\n  constexpr int KIND_K = 1;\n  constexpr int S = 1;\n'
                 '  constexpr int ROTATE = 0;\n  constexpr int ODT = 1;\n')
    assert text == precompiled.INCLUDES + header + signature + body + "}\n"
    assert text.startswith("#include <cuda_fp16.h>\n")


def test_kernel_text_refuses_a_body_that_reads_shapes(monkeypatch):
    monkeypatch.setattr(precompiled, "assemble", lambda name, backend: ("", "  out[0] = records_shape[0];\n"))
    with pytest.raises(ValueError, match="reads records's shape"):
        precompiled.kernel_text("f", "kvarn_unpack", INPUTS, OUTPUTS, {})


def test_cache_key_follows_text_arch_and_versions():
    key = precompiled.cache_key("text", "sm_90a", "0.32.4", "13.0")
    assert key == precompiled.cache_key("text", "sm_90a", "0.32.4", "13.0") and len(key) == 32
    others = {precompiled.cache_key(*args) for args in (("text!", "sm_90a", "0.32.4", "13.0"),
                                                        ("text", "sm_100a", "0.32.4", "13.0"),
                                                        ("text", "sm_90a", "0.32.5", "13.0"),
                                                        ("text", "sm_90a", "0.32.4", "13.1"))}
    assert len(others) == 4 and key not in others
    assert precompiled.arch_of(9, 0) == "sm_90a" and precompiled.arch_of(8, 6) == "sm_86"


def test_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GMLX_KERNEL_CACHE_DIR", str(tmp_path / "here"))
    assert precompiled.folder() == tmp_path / "here"
    monkeypatch.delenv("GMLX_KERNEL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert precompiled.folder() == tmp_path / "xdg" / "gmlx_lab" / "kernels"


def test_a_binary_is_compiled_once_then_read_from_the_folder(fresh, tmp_path):
    function, cubin = precompiled.binary("kvarn_unpack", INPUTS, OUTPUTS, TEMPLATE)
    assert cubin == FAKE_CUBIN + b"sm_90a" and function.startswith("gmlx_kvarn_unpack_")
    (path,) = tmp_path.rglob("*.cubin")
    key = precompiled.cache_key(fresh.texts[0], "sm_90a", mx.__version__, "13.0")
    assert path == tmp_path / f"mlx-{mx.__version__}" / "sm_90a" / "kvarn_unpack" / f"{key}.cubin"
    assert path.read_bytes() == cubin and not list(tmp_path.rglob("*.tmp"))
    precompiled.forget()  # a new process: the folder answers, NVRTC is not called
    assert precompiled.binary("kvarn_unpack", INPUTS, OUTPUTS, TEMPLATE) == (function, cubin)
    assert len(fresh.texts) == 1
    precompiled.binary("kvarn_unpack", INPUTS, OUTPUTS, (*TEMPLATE[:-1], ("ODT", 0)))  # other constants: a new one
    assert len(fresh.texts) == 2 and len(list(tmp_path.rglob("*.cubin"))) == 2


def test_a_damaged_file_is_compiled_again(fresh, tmp_path):
    precompiled.binary("kvarn_unpack", INPUTS, OUTPUTS, TEMPLATE)
    (path,) = tmp_path.rglob("*.cubin")
    path.write_bytes(b"half a fi")
    precompiled.forget()
    assert precompiled.binary("kvarn_unpack", INPUTS, OUTPUTS, TEMPLATE)[1] == FAKE_CUBIN + b"sm_90a"
    assert len(fresh.texts) == 2 and path.read_bytes() == FAKE_CUBIN + b"sm_90a"


def test_no_nvrtc_falls_back_loudly_once(monkeypatch, tmp_path):
    monkeypatch.setenv("GMLX_KERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(precompiled, "nvrtc_candidates", lambda: [])
    precompiled.nvrtc.cache_clear()
    precompiled.forget()
    try:
        with pytest.raises(RuntimeError, match="no NVRTC library found"):
            precompiled.nvrtc()
        with pytest.warns(RuntimeWarning, match="kvarn_unpack: no disk-cached build .*no NVRTC library found"):
            assert precompiled.binary("kvarn_unpack", INPUTS, OUTPUTS, TEMPLATE) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once: another variant falls back without a second warning
            assert precompiled.binary("kvarn_unpack", INPUTS, OUTPUTS, (("B", 6),)) is None
        assert "no NVRTC library found" in precompiled.problems()["kvarn_unpack"]
        assert precompiled.note().startswith("compiled in each process, no kernel disk cache (kvarn_unpack: ")
        assert not list(tmp_path.rglob("*"))
    finally:
        precompiled.nvrtc.cache_clear()
        precompiled.forget()


def test_a_compile_error_falls_back_for_that_kernel_only(fresh):
    fresh.error = "NVRTC could not compile kvarn_seal.cu: error: identifier"
    with pytest.warns(RuntimeWarning, match="kvarn_seal: no disk-cached build"):
        assert precompiled.binary("kvarn_seal", INPUTS, OUTPUTS, TEMPLATE) is None
    fresh.error = None
    assert precompiled.binary("kvarn_unpack", INPUTS, OUTPUTS, TEMPLATE) is not None
    assert list(precompiled.problems()) == ["kvarn_seal"]


def test_an_unwritable_folder_still_runs_the_build(fresh, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")
    monkeypatch.setenv("GMLX_KERNEL_CACHE_DIR", str(blocker))
    with pytest.warns(RuntimeWarning, match="cannot write .*compiled again in each process"):
        assert precompiled.binary("kvarn_unpack", INPUTS, OUTPUTS, TEMPLATE)[1] == FAKE_CUBIN + b"sm_90a"
    assert "cannot write" in precompiled.note()


class Recorder:
    """Stands in for one of MLX's launch functions: keeps its arguments, returns zero outputs."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, **kw):
        self.calls.append(kw)
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]


def cuda_launch(monkeypatch, fresh=None):
    """build.launch as on CUDA, MLX's two launch functions recorded; returns (precompiled's, cuda_kernel's)."""
    monkeypatch.setattr(build, "active_backend", lambda: "cuda")
    pre, jit = Recorder(), Recorder()
    monkeypatch.setattr(build.mx.fast, "precompiled_cuda_kernel", pre)
    monkeypatch.setattr(build, "_kernel", lambda *a: (lambda **kw: jit(**kw)))
    inputs = {"records": mx.zeros((4,), mx.uint32), "params": mx.zeros((2,), mx.int32), "q": mx.zeros((3,), mx.float16)}
    outputs = {"out": ((2, 3), mx.float16), "lse": ((2,), mx.float32)}
    out = build.launch("kvarn_unpack", inputs, outputs, grid=(128, 2, 1), threadgroup=(128, 1, 1),
                       template=dict(TEMPLATE))
    assert [o.shape for o in out] == [(2, 3), (2,)]
    return pre, jit


def test_launch_runs_the_kept_binary_on_cuda(fresh, monkeypatch):
    pre, jit = cuda_launch(monkeypatch)
    assert not jit.calls and len(pre.calls) == 1
    call = pre.calls[0]
    assert call["compiled_source"] == FAKE_CUBIN + b"sm_90a" and call["name"].startswith("gmlx_kvarn_unpack_")
    assert [a.dtype for a in call["inputs"]] == [mx.uint32, mx.int32, mx.float16] and call["scalars"] == []
    assert call["grid"] == (128, 2, 1) and call["threadgroup"] == (128, 1, 1) and call["ensure_row_contiguous"]
    assert f'void {call["name"]}(\n    const unsigned int* records' in fresh.texts[0]


def test_launch_falls_back_to_cuda_kernel(fresh, monkeypatch):
    fresh.error = "NVRTC could not compile"
    with pytest.warns(RuntimeWarning, match="compiled by mx.fast.cuda_kernel in each process instead"):
        pre, jit = cuda_launch(monkeypatch)
    assert not pre.calls and len(jit.calls) == 1 and jit.calls[0]["template"] == list(TEMPLATE)


def test_the_setting_turns_the_cache_off(fresh, monkeypatch):
    with config.configured(kernel_cache=False):
        pre, jit = cuda_launch(monkeypatch)
    assert not pre.calls and len(jit.calls) == 1 and not fresh.texts and not precompiled.problems()
    monkeypatch.setenv("GMLX_KERNEL_CACHE", "0")
    try:
        assert config.reload_environment().kernel_cache is False
    finally:
        monkeypatch.delenv("GMLX_KERNEL_CACHE")
        config.reload_environment()


def test_the_kv_line_says_which_kernels_compile_in_each_process(fresh):
    model = tiny_llama(layers=2)
    assert "kernel disk cache" not in str(gmlx_lab.make_cache(model, "kvarn", bits=4, quiet=True).policy)
    with pytest.warns(RuntimeWarning):
        precompiled.give_up("kvarn_decode", "RuntimeError: no NVRTC library found")
    line = str(gmlx_lab.make_cache(model, "kvarn", bits=4, quiet=True).policy)
    assert "compiled in each process, no kernel disk cache (kvarn_decode: RuntimeError: no NVRTC library found)" in line
