"""Schemes as plug-ins: a scheme defined only in tests/ (toy_scheme.py) through every part of gmlx_lab,
the block base against the built-in affine cache, and the seams between modules."""

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import toy_scheme
from conftest import random_kv, tiny_llama
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import gmlx_lab
from gmlx_lab import cli, viz
from gmlx_lab.cache import AffineCache, AffineRotCache, BlockCache, BlockScheme
from gmlx_lab.cache.block import block_regions
from gmlx_lab.measure.memory import memory_report
from gmlx_lab.registry import SCHEMES, Option, get_scheme, register_scheme

ROOT = Path(__file__).resolve().parents[1]
TOY = Path(toy_scheme.__file__)


# -- the toy plug-in everywhere ---------------------------------------------------------------------------


def test_registered_and_parsed_like_a_built_in(model, capsys):
    assert SCHEMES["toy"] is toy_scheme.SCHEME and list(SCHEMES)[:4] == ["fp16", "affine", "affine_rot", "float"]
    assert gmlx_lab.parse_scheme_spec("toy4:tail=0") == ("toy", {"bits": 4, "kv_tail_tokens": 0})
    cache = gmlx_lab.make_cache(model, "toy", bits=4, name="tiny")
    assert capsys.readouterr().out.strip() == ("[kv] tiny: toy4 tail=16 -> quantized 3/4 attn layers "
                                              "(layer 3 fp16: last of deep stack); toy: reference decode path "
                                              "(dequantize, then SDPA; no fused kernel)")
    assert [type(c).__name__ for c in cache] == ["ToyCache"] * 3 + ["FP16Cache"]
    assert cache.policy.as_dict()["bits"] == 4 and cache[0].bits == 4 and cache[0].sink_tokens == 4


def test_unknown_names_and_values_are_clear_errors(model):
    accepted = "fp16, affine, affine_rot, float, kivi, kvarn, .*toy"
    with pytest.raises(ValueError, match=f"unknown scheme 'toyz'; accepted: {accepted}"):
        gmlx_lab.make_cache(model, "toyz", quiet=True)
    with pytest.raises(ValueError, match="toy: bits=6 is not supported; accepted: 4, 8"):
        gmlx_lab.make_cache(model, "toy", quiet=True, bits=6)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['group_size'\]; accepted options: bits, "):
        gmlx_lab.parse_scheme_spec("toy8:g=32")
    split = "only kivi, kvarn, turboquant store K and V at different widths; toy has one 'bits'"
    with pytest.raises(ValueError, match=split):
        gmlx_lab.parse_scheme_spec("toy:k8v4")


def test_policy_rule_comes_from_what_the_class_can_encode():
    p = gmlx_lab.policy(tiny_llama(layers=3, head_dim=48), "toy", name="hd48")
    assert [d.decision for d in p.layers] == ["fp16"] * 3
    assert str(p).startswith("[kv] hd48: toy8 tail=16 -> no layer can use toy (layers 0,1 fp16: ToyCache cannot "
                             "encode K blocks of head_dim 48")
    assert [d.decision for d in gmlx_lab.policy(tiny_llama(layers=3, head_dim=64), "toy").layers] == [
        "toy", "toy", "fp16"]


def test_mlx_lm_generate_and_save_load_roundtrip(tmp_path):
    import mlx_lm

    model, tokenizer = gmlx_lab.load()
    prompt = "ROMEO:\n" + "But soft, what light through yonder window breaks? " * 4
    cache = gmlx_lab.make_cache(model, "toy", quiet=True, bits=4)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=8, prompt_cache=cache)
    assert text.strip() and cache[0].n_blocks >= 1 and cache[0].sink_count == 4
    path = str(tmp_path / "toy.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    for a, b in zip(cache, loaded):
        assert _leaves_equal(a.state, b.state)
    assert (loaded[0].bits, loaded[0].kv_tail_tokens, loaded[0].kv_shape) == (4, 16, cache[0].kv_shape)
    nxt = mx.array([[5, 6, 7]])
    assert mx.array_equal(model(nxt, cache=cache), model(nxt, cache=loaded))


def _leaves_equal(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_leaves_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, mx.array):
        return a.dtype == b.dtype and bool(mx.array_equal(a, b))
    return a == b


def test_fidelity_memory_and_the_byte_formula(model):
    tokens = mx.random.randint(0, 300, (209,), key=mx.random.key(4)).tolist()
    result = gmlx_lab.fidelity(model, None, tokens, ["toy8", "toy4:tail=0"], prefill=200, decode=8)
    toy8, toy4 = result["toy8"], result["toy4:tail=0"]
    assert toy8.audit.ok and toy4.audit.ok and 0 < toy8.decode_mean_kl < toy4.decode_mean_kl
    assert toy4.audit.layers[0].regions["body"] > 0 and toy4.label == "toy4 tail=0"
    report = memory_report(model, ["fp16", "toy8", "toy4"], context=300)
    pol = gmlx_lab.policy(model, "toy", bits=8)
    assert report["toy8 tail=16"].resident == viz.policy_bytes(pol, 300)
    assert report["toy8 tail=16"].resident < report["fp16"].resident  # (toy stores int8 codes at either width)
    body, fp16 = report["toy8 tail=16"].by_region()["body"]
    assert body / fp16 == pytest.approx((128 + 4 * 2) / 256)  # int8 codes + an fp16 scale per 32 values


def test_widget_builders(model):
    from gmlx_lab import widgets

    picker = widgets.model_picker()
    app = widgets.compare(picker.model, picker.tokenizer, context_tokens=160, max_tokens=4, tail=0,
                          schemes=["fp16", "affine", "toy"])
    assert app.chosen() == ["affine", "toy"]  # fp16 is always there: the reference column
    assert app.options("toy") == {"bits": 4, "kv_tail_tokens": 0}  # the K width (4) and the tail control (0)
    app.linked.value, app.v_bits.value = False, 6
    assert app.options("kvarn") == {"k_bits": 4, "v_bits": 6, "kv_tail_tokens": 0}  # K and V widths apart
    assert app.options("affine") == {"bits": 4}  # one width (the K width's), no tail option
    assert [c.label for c in app.live.columns] == ["fp16", "affine4 g64", "toy4 tail=0"]
    assert "tokens/s" in app.stats.value and not app.tail.disabled  # toy has a tail
    app.k_bits.value = 2  # toy takes 4 or 8: the app says so and runs the others
    app.generate()
    assert "bits=2 is not supported; accepted: 4, 8" in app.status.value
    assert [c.label for c in app.live.columns] == ["fp16", "affine2 g64"]
    assert viz.scheme_color("toy4 tail=0") == "#2ca02c"
    assert isinstance(viz.policy_strip([gmlx_lab.policy(model, "toy")]).to_json(), str)


def test_error_plots_use_the_scheme_roundtrip():
    k, _ = random_kv(64, heads=1)
    x = np.array(k[0, 0])
    assert 0 < viz.quant_error(x, "toy", 8) < viz.quant_error(x, "toy", 4) < 0.2


def test_cli_plugin_by_module_name_and_by_path(capsys):
    argv = ["--plugin", "toy_scheme", "memory", "--model", "llama", "--context", "300", "--schemes", "fp16,toy8",
            "--json"]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["label"] for s in data["schemes"]] == ["fp16", "toy8 tail=16"]
    argv = ["--plugin", str(TOY), "fidelity", "--model", "llama", "--prefill", "150", "--decode", "3",
            "--schemes", "fp16,toy4:tail=0", "--json", "--quiet"]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["schemes"][1]["audit"]["ok"]
    assert cli.main(["--plugin", "no_such_plugin", "schemes"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gmlx-lab: error: cannot import plug-in 'no_such_plugin'") and "\n" not in err


def test_cli_plugin_in_a_fresh_process():
    """Without the test session's imports: only --plugin registers the scheme."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "-m", "gmlx_lab.cli", "--plugin", str(TOY.relative_to(ROOT)), "policy", "llama",
           "--schemes", "toy4"]
    proc = subprocess.run(run, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "[kv] llama-specimen: toy4 tail=16 -> quantized 3/4 attn layers" in proc.stdout


# -- the block base ----------------------------------------------------------------------------------------


def toy(**options) -> BlockCache:
    return toy_scheme.ToyCache(**{"bits": 8, "kv_tail_tokens": 16, "sink_tokens": 4, **options})


@pytest.mark.parametrize("tail", [0, 16, 40])
@pytest.mark.parametrize("chunks", [[1] * 100, [3, 50, 1, 46], [100]])
def test_regions_follow_the_geometry_and_chunking_does_not_matter_once_sealed(tail, chunks):
    k, v = random_kv(100, seed=1)
    caches = []
    for parts in (chunks, [100]):
        cache, start = toy(kv_tail_tokens=tail), 0
        for n in parts:
            kk, vv = cache.update_and_fetch(k[:, :, start:start + n], v[:, :, start:start + n])
            start += n
        assert cache.region_tokens() == block_regions(100, 16, 4, tail, newest=parts[-1])
        assert kk.shape == k.shape and cache.nbytes == sum(cache.regions().values())
        cache.seal()
        assert cache.region_tokens() == block_regions(100, 16, 4, tail)
        caches.append(cache)
    assert _leaves_equal(caches[0].state, caches[1].state)
    assert caches[0].regions()["body"] == caches[0].n_blocks * 2 * toy().block_bytes(128, 128)


def test_fetch_returns_fp16_regions_exactly_and_blocks_as_decoded():
    k, v = random_kv(90)
    cache = toy(kv_tail_tokens=20)
    cache.update_and_fetch(k[:, :, :89], v[:, :, :89])
    kk, vv = cache.update_and_fetch(k[:, :, 89:], v[:, :, 89:])
    r = cache.region_tokens()
    assert r == {"sink": 4, "body": 64, "live": 2, "tail": 20}
    fp16 = list(range(4)) + list(range(68, 90))
    assert mx.array_equal(kk[:, :, fp16], k[:, :, fp16].astype(mx.float16).astype(mx.float32))
    body = slice(4, 68)
    assert mx.array_equal(vv[:, :, body], cache.roundtrip(v[:, :, body], "v"))
    rel = mx.sqrt(mx.mean((kk[:, :, body] - k[:, :, body]) ** 2) / mx.mean(k[:, :, body] ** 2))
    assert 0 < float(rel) < 0.02
    q = mx.random.normal((1, 4, 3, 128))
    ours = cache.attend(q, kk, vv, scale=0.088, mask="causal")
    assert mx.allclose(ours, mx.fast.scaled_dot_product_attention(q, kk, vv, scale=0.088, mask="causal"))


def test_trim_deepcopy_and_errors():
    k, v = random_kv(60)
    cache = toy()
    cache.update_and_fetch(k[:, :, :50], v[:, :, :50])
    cache.update_and_fetch(k[:, :, 50:], v[:, :, 50:])
    twin = copy.deepcopy(cache)
    assert cache.trim(10) == 10 and cache.offset == 50 and twin.offset == 60
    with pytest.raises(ValueError, match="cannot trim .* encoded into blocks cannot be restored exactly"):
        cache.trim(cache.recent_count + 1)
    assert cache.trim(cache.recent_count) > 0 and cache.recent_count == 0
    before_blocks = toy()
    before_blocks.update_and_fetch(k[:, :, :3], v[:, :, :3])
    assert before_blocks.trim(3) == 3 and before_blocks.sink is None
    with pytest.raises(ValueError, match="layer 2: ToyCache cannot encode K blocks of head_dim 48"):
        toy(layer=2).update_and_fetch(*random_kv(5, dim=48))
    with pytest.raises(ValueError, match="toy: kv_tail_tokens=-1 is not supported; accepted: an int >= 0"):
        toy(kv_tail_tokens=-1)
    with pytest.raises(ValueError, match="option name 'offset' clashes"):
        toy(offset=3)
    with pytest.raises(ValueError, match="tiny: toy8 tail=16: ToyCache has no rolling window"):
        gmlx_lab.policy(tiny_llama(layers=2), "toy", name="tiny", max_kv_size=1024)


def test_register_refuses_clashes_and_accepts_a_rerun():
    class ToyCache(BlockCache):  # another class of the same name, in another module
        scheme = "toy"

    with pytest.raises(ValueError, match="scheme 'toy' is already registered"):
        register_scheme(BlockScheme("toy", "again", cache_class=ToyCache))
    with pytest.raises(ValueError, match="ToyCache.scheme is 'toy'"):
        BlockScheme("other", "mismatch", cache_class=ToyCache)

    class KVCache(BlockCache):
        scheme = "clash"

    with pytest.raises(ValueError, match="cache class name 'KVCache' is taken in mlx_lm.models.cache"):
        register_scheme(BlockScheme("clash", "x", cache_class=KVCache))
    assert "clash" not in SCHEMES
    again = BlockScheme("toy", toy_scheme.SCHEME.summary, toy_scheme.SCHEME.options, toy_scheme.ToyCache)
    assert register_scheme(again) is again and get_scheme("toy") is again  # a re-run notebook cell
    register_scheme(toy_scheme.SCHEME)


# -- affine is a block scheme ------------------------------------------------------------------------------------


class AffineBlocks(BlockCache):
    """mlx-lm's affine cache written as a block scheme: blocks of one token, encoded as they arrive."""

    scheme = "affine_blocks"
    block_tokens = 1
    encode_on_arrival = True
    OPTIONS = (Option("bits", 4, "code width", (2, 3, 4, 6, 8)), Option("group_size", 64, "group", (32, 64, 128)))

    def encode(self, x, kind):
        return mx.quantize(x.astype(mx.float16), group_size=self.group_size, bits=self.bits)

    def decode(self, parts, kind):
        codes, scales, biases = parts
        f32 = mx.float32
        return mx.dequantize(codes, scales.astype(f32), biases.astype(f32), group_size=self.group_size, bits=self.bits)


class RotatedAffineBlocks(AffineBlocks):
    rotate = unrotate = staticmethod(mx.hadamard_transform)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("bits, group", [(2, 32), (3, 64), (4, 128), (6, 64), (8, 32)])
def test_affine_as_a_block_scheme_stores_and_returns_what_affine_cache_does(bits, group, rotate):
    k, v = random_kv(60, seed=bits)
    # fp16 values: the block base keeps arriving tokens in fp16 before it rotates them, AffineRotCache rotates
    # first (rotate_on_arrival)
    k, v = (x.astype(mx.float16).astype(mx.float32) for x in (k, v))
    ours = (RotatedAffineBlocks if rotate else AffineBlocks)(bits=bits, group_size=group)
    theirs = (AffineRotCache if rotate else AffineCache)(bits, group)
    start = 0
    for n in (7, 1, 1, 51):
        a = ours.update_and_fetch(k[:, :, start:start + n], v[:, :, start:start + n])
        b = theirs.update_and_fetch(k[:, :, start:start + n], v[:, :, start:start + n])
        start += n
        assert all(mx.array_equal(x, y) for x, y in zip(a, b))
    for mine, packed in zip(ours.body, theirs.body):
        for part, codes in zip(mine, packed):
            assert mx.array_equal(part.reshape(codes.shape), codes)


# -- the seams -----------------------------------------------------------------------------------------------------


def _python_sources():
    """(path, module name, source) of every Python file and notebook code cell we ship or test."""
    for folder in ("gmlx_lab", "tests", "benchmarks", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield path, name, path.read_text(encoding="utf-8")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
        yield path, path.stem, code


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Absolute names an import statement brings in (`from .x import y` in gmlx_lab.a gives gmlx_lab.x.y)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = module.split(".")
    base = base if is_package else base[:-1]
    if node.level:
        base = base[: len(base) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [f"{prefix}.{a.name}" for a in node.names]


def test_no_kernel_module_imports_the_caches():
    """Kernels take arrays in the formats' layouts (kvarn's records, the K/V pair) and know no cache class."""
    formats = ("gmlx_lab.cache.kvarn.records.", "gmlx_lab.cache.buffers.KV")
    for path in sorted((ROOT / "gmlx_lab" / "kernels").glob("*.py")):
        module = "gmlx_lab.kernels" + ("" if path.stem == "__init__" else "." + path.stem)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(node, module, path.stem == "__init__"):
                    if name.startswith(formats):
                        continue
                    assert not (name + ".").startswith("gmlx_lab.cache."), f"{path.name} imports {name}"


def test_nothing_uses_another_modules_private_names():
    """No `from m import _x`, no `m._x` on a module, and `obj._x` only in the module that defines `_x`."""
    ours = {"gmlx_lab"} | {p.stem for folder in ("tests", "benchmarks") for p in (ROOT / folder).glob("*.py")}
    problems = []
    for path, _module, source in _python_sources():
        tree = ast.parse(source)
        defined = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
        defined |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in ours):
                problems += [f"{path.name}: imports {a.name}" for a in node.names if _private(a.name)]
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in defined:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    problems.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert problems == []


def _private(name: str) -> bool:
    protocol = name.startswith(("_repr_", "_ipython_")) and name.endswith("_")  # IPython's display hooks
    return name.startswith("_") and not name.startswith("__") and not protocol


def test_no_string_dispatch_on_scheme_names_outside_the_registry_and_the_schemes():
    """`x == "kvarn"`, `x in ("affine", ...)`: only the registry and each scheme's own folder (cache/)."""
    names = {"fp16", "affine", "affine_rot", "kvarn"}
    own = ("gmlx_lab.registry", "gmlx_lab.cache")
    problems = []
    for path, module, source in _python_sources():
        if not module.startswith("gmlx_lab") or module.startswith(own):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Compare):
                values = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
                problems += [f"{path.name}:{node.lineno}: {ast.unparse(node)}" for _ in values[:1]]
    assert problems == []
