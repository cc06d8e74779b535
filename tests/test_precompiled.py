"""The CUDA kernel disk cache (gmlx_lab/kernels/precompiled.py): the text NVRTC gets, where binaries are kept,
and how launches fall back to mx.fast.cuda_kernel, loudly, when no binary can be had. NVRTC and the GPU are
stood in for here (a recording compiler, a recording launch); benchmarks/gpu_check.sh runs the real ones."""

import warnings
from functools import cache
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import tiny_llama

import gmlx_lab
from gmlx_lab.kernels import build, config, precompiled, selfcheck
from gmlx_lab.kernels.sources import assemble, compact

INPUTS = (("records", mx.uint32), ("params", mx.int32), ("q", mx.float16))
OUTPUTS = (("out", mx.float16), ("lse", mx.float32))
TEMPLATE = (("B", 4), ("KIND_K", 1), ("S", 1), ("ROTATE", 0), ("ODT", 1))
FAKE_CUBIN = precompiled.ELF_MAGIC + b"cubin"
HANDOFF_PROBE = precompiled.handoff_works  # the real probe (the fixtures stand in for it)


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
    monkeypatch.setenv("GMLX_LAB_CACHE", str(tmp_path))
    fake = FakeNvrtc()
    monkeypatch.setattr(precompiled, "nvrtc", lambda: fake)
    monkeypatch.setattr(precompiled, "device_arch", lambda: "sm_90a")
    build.forget_kernels()
    # no MLX that reads binaries handed to it (mlx_folder below stands one in): launches run precompiled ones
    monkeypatch.setattr(precompiled, "handoff_works", cache(lambda: False))
    yield fake
    # on a GPU the stand-in binaries must not outlive the test: in compiled decode graphs, in self-check results
    build.forget_kernels()
    selfcheck.reset()


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


def test_folder_is_in_the_lab_cache(monkeypatch, tmp_path):
    """One user cache for models and kernels: $GMLX_LAB_CACHE/kernels, else under XDG's cache folder."""
    monkeypatch.setenv("GMLX_LAB_CACHE", str(tmp_path / "here"))
    assert precompiled.folder() == tmp_path / "here" / "kernels"
    monkeypatch.delenv("GMLX_LAB_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert precompiled.folder() == tmp_path / "xdg" / "gmlx_lab" / "kernels"


def test_a_binary_is_compiled_once_then_read_from_the_folder(fresh, tmp_path):
    function, cubin = precompiled.binary("kvarn_unpack", INPUTS, OUTPUTS, TEMPLATE)
    assert cubin == FAKE_CUBIN + b"sm_90a" and function.startswith("gmlx_kvarn_unpack_")
    (path,) = tmp_path.rglob("*.cubin")
    key = precompiled.cache_key(fresh.texts[0], "sm_90a", mx.__version__, "13.0")
    assert path == tmp_path / "kernels" / f"mlx-{mx.__version__}" / "sm_90a" / "kvarn_unpack" / f"{key}.cubin"
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
    monkeypatch.setenv("GMLX_LAB_CACHE", str(tmp_path))
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
    monkeypatch.setenv("GMLX_LAB_CACHE", str(blocker))
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
    monkeypatch.setattr(build, "_kernel", cache(lambda *a: (lambda **kw: jit(**kw))))
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


def test_the_kv_line_says_which_kernels_compile_in_each_process(fresh):
    model = tiny_llama(layers=2)
    assert "kernel disk cache" not in str(gmlx_lab.make_cache(model, "kvarn", bits=4, quiet=True).policy)
    with pytest.warns(RuntimeWarning):
        precompiled.give_up("kvarn_decode", "RuntimeError: no NVRTC library found")
    line = str(gmlx_lab.make_cache(model, "kvarn", bits=4, quiet=True).policy)
    assert "compiled in each process, no kernel disk cache (kvarn_decode: RuntimeError: no NVRTC library found)" in line


# -- the binary handed to MLX's module cache ------------------------------------------------------------------
HASHER = r"""
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
int main() { std::stringstream in; in << std::cin.rdbuf(); std::printf("%zx", std::hash<std::string>{}(in.str())); }
"""


def test_std_hash_is_libstdcxxs(tmp_path):
    """MLX names a custom kernel's module by std::hash of its text: the same numbers as a C++ program's."""
    import subprocess

    (tmp_path / "h.cpp").write_text(HASHER)
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "h"), str(tmp_path / "h.cpp")], check=True)
    header, body = (compact(t) for t in assemble("kvarn_decode", "cuda"))
    for text in ("", "a", "abcdefg", "abcdefgh", "abcdefghi", header + body):
        data = text.encode()
        run = subprocess.run([str(tmp_path / "h")], input=data, capture_output=True, check=True)
        assert f"{precompiled.std_hash(data):x}" == run.stdout.decode(), text[:20]


def test_mlx_text_is_mlxs_build_kernel():
    """The text mx.fast.cuda_kernel writes around a body (MLX 0.32's custom_kernel.cpp, build_kernel)."""
    name = precompiled.mlx_kernel_name("gmlx_f", TEMPLATE)
    assert name == "custom_kernel_gmlx_f_4_1_1_0_1"
    text = precompiled.mlx_text(name, "#define H 1\n", "  out[0] = 1;\n", INPUTS, OUTPUTS, TEMPLATE)
    assert text == ('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n#define H 1\n'
                    'namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n'
                    '__global__ void custom_kernel_gmlx_f_4_1_1_0_1(\n    const uint32_t* records,\n'
                    '    const int32_t* params,\n    const __half* q,\n    __half* out,\n    float* lse) {\n'
                    '  constexpr int B = 4;\n  constexpr int KIND_K = 1;\n  constexpr int S = 1;\n'
                    '  constexpr int ROTATE = 0;\n  constexpr int ODT = 1;\n\n  out[0] = 1;\n\n}\n\n'
                    '} // namespace mlx::core::cu\n')


def test_mlx_module_folder_follows_mlxs_rules(monkeypatch, tmp_path):
    for var in ("MLX_PTX_CACHE_DIR", "TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(var, raising=False)
    assert precompiled.mlx_module_folder() == Path("/tmp/mlx") / mx.__version__ / "ptx"
    monkeypatch.setenv("TEMP", str(tmp_path / "temp"))
    monkeypatch.setenv("TMP", str(tmp_path / "tmp"))
    assert precompiled.mlx_module_folder() == tmp_path / "tmp" / "mlx" / mx.__version__ / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    assert precompiled.mlx_module_folder() == tmp_path / "ptx"


class FakeMlx:
    """Stands in for mx.fast.cuda_kernel as MLX 0.32 runs the probe: the module is the file named by the text's
    hash in the PTX folder when there is one (its entry point listed in the .txt), else the text compiled."""

    def __init__(self):
        self.compiled: list[str] = []
        self.hash = precompiled.std_hash  # MLX's own, whatever a test does to precompiled's

    def cuda_kernel(self, name, input_names, output_names, source, header=""):
        def run(inputs, template, output_shapes, output_dtypes, **_):
            kernel_name = precompiled.mlx_kernel_name(name, tuple(template))
            text = precompiled.mlx_text(kernel_name, header, source, tuple(zip(input_names, (a.dtype for a in inputs))),
                                        tuple(zip(output_names, output_dtypes)), tuple(template))
            path = precompiled.mlx_module_folder() / f"{kernel_name}_{self.hash(text.encode()):x}.ptx"
            if path.exists():
                entries = dict(line.split("\t") for line in path.with_suffix(".txt").read_text().splitlines())
                assert f"mlx::core::cu::{kernel_name}" in entries
                added = 2 if path.read_bytes().endswith(b"add2") else 0  # the probe's binary adds 2
            else:
                self.compiled.append(kernel_name)
                added = 1  # the text adds 1
            return [inputs[0] + added]
        return run


@pytest.fixture
def mlx_folder(fresh, monkeypatch, tmp_path):
    """MLX's PTX folder under tmp_path, a stand-in for MLX's cuda_kernel reading it, NVRTC's probe binary marked."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    fake = FakeMlx()
    monkeypatch.setattr(precompiled.mx.fast, "cuda_kernel", fake.cuda_kernel)
    monkeypatch.setattr(precompiled, "handoff_works", HANDOFF_PROBE)
    compile_ = fresh.compile
    fresh.compile = lambda text, arch, filename: compile_(text, arch, filename) + (b"add2" if "2u" in text else b"")
    return fake


def test_the_probe_finds_mlx_reading_the_folder(mlx_folder):
    assert precompiled.handoff_works() and not mlx_folder.compiled and not precompiled.problems()


def test_a_probe_that_mlx_compiles_says_the_launch_is_slower(mlx_folder, monkeypatch):
    monkeypatch.setattr(precompiled, "std_hash", lambda data: 7)  # as if MLX named modules otherwise
    with pytest.warns(RuntimeWarning, match="handoff_probe: MLX compiled the probe's text"):
        assert not precompiled.handoff_works()
    assert mlx_folder.compiled and "a slower launch, binary not handed to MLX" in precompiled.note()


def test_launch_hands_the_binary_to_mlx_and_runs_cuda_kernel(mlx_folder, monkeypatch, tmp_path):
    pre, jit = cuda_launch(monkeypatch)
    assert not pre.calls and len(jit.calls) == 1 and not precompiled.problems()
    function, cubin = precompiled.binary("kvarn_unpack", INPUTS, OUTPUTS, TEMPLATE)
    kernel_name = precompiled.mlx_kernel_name(function, TEMPLATE)
    header, body = (compact(t) for t in assemble("kvarn_unpack", "cuda"))
    text = precompiled.mlx_text(kernel_name, header, body, INPUTS, OUTPUTS, TEMPLATE)
    path = tmp_path / "ptx" / f"{kernel_name}_{precompiled.std_hash(text.encode()):x}.ptx"
    assert path.read_bytes() == cubin
    assert path.with_suffix(".txt").read_text() == f"mlx::core::cu::{kernel_name}\t{function}\n"


def test_launch_without_the_handoff_runs_precompiled(mlx_folder, monkeypatch):
    monkeypatch.setattr(precompiled, "handoff_works", cache(lambda: False))
    pre, jit = cuda_launch(monkeypatch)
    assert len(pre.calls) == 1 and not jit.calls


def test_on_cuda_mlx_runs_what_is_handed_to_it(capfd):
    """On CUDA (benchmarks/gpu_check.sh) the real probe, and MLX's own text for a kernel (verbose=True) is the
    text whose hash names its module; elsewhere the stand-in tests above."""
    from gmlx_lab.kernels import active_backend

    if active_backend() != "cuda":
        assert build.active_backend() != "cuda" and precompiled.mlx_kernel_name("f", ()) == "custom_kernel_f"
        return
    precompiled.forget()
    assert HANDOFF_PROBE(), precompiled.problems()
    header, body = (compact(t) for t in assemble("kvarn_unpack", "cuda"))
    kernel = mx.fast.cuda_kernel(name="gmlx_text_check", input_names=[n for n, _ in INPUTS],
                                 output_names=[n for n, _ in OUTPUTS], source=body, header=header)
    capfd.readouterr()
    kernel(inputs=[mx.zeros((4,), d) for _, d in INPUTS], template=list(TEMPLATE), grid=(1, 1, 1),
           threadgroup=(1, 1, 1), output_shapes=[(1,), (1,)], output_dtypes=[d for _, d in OUTPUTS], verbose=True)
    printed = capfd.readouterr().out
    kernel_name = precompiled.mlx_kernel_name("gmlx_text_check", TEMPLATE)
    expected = precompiled.mlx_text(kernel_name, header, body, INPUTS, OUTPUTS, TEMPLATE)
    assert f"```\n{expected}\n```" in printed
