"""The gmlx-lab command line: policy, fidelity --json, memory, errors as one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gmlx_lab import cli

ROOT = Path(__file__).resolve().parents[1]


def test_policy_llama(capsys):
    assert cli.main(["policy", "llama"]) == 0
    out = capsys.readouterr().out
    assert "[kv] llama-specimen: kvarn6 tail=1024 -> quantized 3/4 attn layers" in out
    assert "| 3 | attention | KVCache | 2 | 128 | fp16 | last of deep stack |" in out
    assert "affine8 g64" in out


def test_policy_gpt_oss(capsys):
    assert cli.main(["policy", "gpt_oss", "--schemes", "kvarn"]) == 0
    out = capsys.readouterr().out
    assert "no layer can use kvarn" in out and "-> running fp16" in out
    assert "head_dim 64: kvarn needs 128/256/512" in out and "sliding window" in out


def test_fidelity_json(capsys):
    argv = ["fidelity", "--model", "llama", "--prefill", "200", "--decode", "6", "--schemes",
            "fp16,affine4,kvarn:k8v4,tail=0", "--json", "--quiet"]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["label"] for s in data["schemes"]] == ["fp16", "affine4 g64", "kvarn k8v4 tail=0"]
    assert data["schemes"][0]["decode_median_kl"] == 0.0
    assert data["schemes"][2]["audit"]["ok"]


def test_memory_json(capsys):
    assert cli.main(["memory", "--model", "llama", "--context", "512", "--schemes", "fp16,kvarn6:tail=0",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schemes"][1]["by_region"]["body"]["bytes"] > 0


def test_bad_scheme_is_one_line_without_traceback():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "gmlx_lab.cli", "fidelity", "--schemes", "affine4,kvarn7"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gmlx-lab: error: kvarn: bits=7 is not supported; accepted: 2, 3, 4, 5, 6, 8"]
    assert proc.stdout == ""


def test_unknown_model(capsys):
    assert cli.main(["policy", "no-such-model"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gmlx-lab: error: unknown model 'no-such-model'") and len(err.splitlines()) == 1


def test_lab_without_jupyterlab(monkeypatch, capsys, tmp_path):
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    assert cli.main(["lab"]) == 1
    assert "jupyterlab is not installed" in capsys.readouterr().err


def test_lab_finds_notebooks(monkeypatch, tmp_path):
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path)
    assert cli.find_notebooks() == tmp_path / "notebooks"


@pytest.mark.parametrize("argv", [["fidelity", "--prefill", "x"], ["nonsense"]])
def test_argparse_errors_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2


def test_scheme_list_keeps_options_with_their_scheme_and_rejects_unknown(capsys):
    assert cli.scheme_list("fp16,kvarn:k8v4,tail=128,affine4") == ["fp16", "kvarn:k8v4,tail=128", "affine4"]
    assert cli.scheme_list("fp16,nvfp4_rot:tail=128,sink=4,turboquant:k3v4,qjl=1") == [
        "fp16", "nvfp4_rot:tail=128,sink=4", "turboquant:k3v4,qjl=1"]  # spec words start a scheme too
    assert cli.main(["compare", "--schemes", "fp16,bogus", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gmlx-lab: error: unknown scheme in 'bogus'") and "\n" not in err


def test_schemes_lists_the_registry(capsys):
    from gmlx_lab.registry import SCHEMES

    assert cli.main(["schemes"]) == 0
    out = capsys.readouterr().out
    for scheme in SCHEMES.values():
        assert f"**{scheme.name}**" in out
        for opt in scheme.options:
            assert f"| {opt.name} | {opt.default} | {opt.accepted()} |" in out


def test_policy_overrides_on_the_command_line(capsys):
    argv = ["policy", "gemma3", "--schemes", "affine4", "--quantize-layers", "1,5", "--quantize-last", "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)[0]
    assert report["overrides"] == {"layers": [1, 5], "fp16_layers": [], "quantize_last": True,
                                   "quantize_sliding": False}
    assert [d["index"] for d in report["layers"] if d["decision"] == "affine"] == [1, 5, 11]
    assert cli.main(["policy", "gemma3", "--schemes", "kvarn", "--quantize-sliding", "--fp16-layers", "0"]) == 0
    out = capsys.readouterr().out
    assert "kvarn6 tail=1024 +sliding -fp16 0 -> quantized 1/2 attn layers" in out
    assert "9/10 sliding-window quantized" in out and "layer 0 override: kept fp16 by request (fp16_layers)" in out


@pytest.mark.parametrize("flags, message", [
    (["--quantize-layers", "5,x"], "--quantize-layers '5,x': cannot read 'x' in '5,x' as int; accepted: "
                                   "comma-separated layer indices such as 5,11"),
    (["--quantize-layers", "12"], "layers has 12; accepted: layer indices 0..11 (the model has 12 cache entries)"),
    (["--fp16-layers", "-3"], "fp16_layers has -3; accepted: layer indices 0..11"),
])
def test_bad_override_flags_are_one_line_errors(capsys, flags, message):
    assert cli.main(["policy", "gemma3", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_memory_and_fidelity_take_overrides(capsys):
    argv = ["memory", "--model", "gemma3", "--context", "600", "--schemes", "fp16,affine4", "--quantize-sliding",
            "--json"]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["label"] for s in data["schemes"]] == ["fp16", "affine4 g64 +sliding"]
    fp16, affine = data["schemes"]
    assert fp16["layers"][0]["regions"] == {"window": 128 * 256 * 2 * 2}  # the model's 128-token window at fp16
    assert affine["layers"][0]["decision"] == "affine" and 0 < affine["layers"][0]["resident"]
    argv = ["fidelity", "--model", "gemma3", "--prefill", "300", "--decode", "4", "--schemes", "affine8",
            "--quantize-sliding", "--quantize-last", "--json", "--quiet"]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schemes"][0]["label"] == "affine8 g64 +last +sliding" and data["schemes"][0]["audit"]["ok"]
    assert data["schemes"][0]["quantized_layers"] == "12/12"


def test_a_bad_option_value_gets_its_options_message_at_every_entry_point(capsys):
    """A value has one check, its Option (gmlx_lab.registry): the command line, make_cache, the spec parser and
    the cache's constructor all answer kv_tail_tokens=-1 with that Option's message."""
    from conftest import tiny_llama

    from gmlx_lab import make_cache, parse_scheme_spec
    from gmlx_lab.cache import KvarnCache

    want = "kvarn: kv_tail_tokens=-1 is not supported; accepted: an int >= 0"
    assert cli.main(["policy", "llama", "--schemes", "kvarn6:tail=-1"]) == 2
    assert capsys.readouterr().err.strip() == f"gmlx-lab: error: {want}"
    for entry in (lambda: make_cache(tiny_llama(layers=2), "kvarn", kv_tail_tokens=-1, quiet=True),
                  lambda: parse_scheme_spec("kvarn6:tail=-1"),
                  lambda: KvarnCache(kv_tail_tokens=-1, layer=1)):
        with pytest.raises(ValueError, match=want):
            entry()
