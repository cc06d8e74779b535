"""The project's shape: its modules import in tiers (no import circle), and its configuration says what the tests do."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gmlx_lab.kernels import active_backend

PACKAGE = Path(__file__).resolve().parents[1] / "gmlx_lab"
# Circles known and owned elsewhere; the test fails on any other (kernels/build <-> kernels/threads is gone:
# the kernels' texts live in kernels/sources.py, which both import).
KNOWN_CIRCLES: set[tuple[str, ...]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth (functions' too), except those under `if TYPE_CHECKING:`."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found += [n for child in node.orelse for n in runtime_imports(ast.Module([child], []))]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        else:
            found += runtime_imports(node)
    return found


def import_graph() -> dict[str, set[str]]:
    """gmlx_lab's modules and the gmlx_lab modules each one imports (a package means its __init__)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                edges |= {full} if full in files else {target} if target in files else set()
        graph[name] = edges - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(tuple(sorted(group)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_inside_gmlx_lab() -> None:
    """Modules import in tiers: a module never reaches itself through its imports (lazy ones inside functions
    count too: they only hide a circle). Every circle is listed; only the known ones are let through."""
    found = circles(import_graph())
    assert set(found) <= KNOWN_CIRCLES, f"modules importing each other: {[', '.join(c) for c in found]}"


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [("a", "b", "c")]


def test_the_gpu_marker_says_what_happens_without_a_gpu(request: pytest.FixtureRequest) -> None:
    """`gpu` tests are not deselected on a CPU-only machine: conftest runs them on CPU threads, and the marker's
    text (pytest --markers) says so."""
    (text,) = [line for line in request.config.getini("markers") if line.startswith("gpu:")]
    assert "deselected" not in text and "CPU threads" in text and "CUDA and Metal" in text
    if active_backend() == "cpu":  # and they do: each gpu test of this session is parametrized by its source
        for item in request.session.items:
            if item.get_closest_marker("gpu"):
                assert item.callspec.params["kernel_source"] in ("cuda", "metal")


def test_the_measurement_modules_have_one_path() -> None:
    """gmlx_lab/measure/ is where they live: no second path under gmlx_lab (a 0.1.0 package keeps no aliases)."""
    import importlib

    import gmlx_lab
    from gmlx_lab import measure, tradeoff

    assert tradeoff is measure.tradeoff and callable(gmlx_lab.fidelity) and callable(gmlx_lab.audit)
    for name in ("experiments", "fidelity", "memory", "metrics", "tradeoff"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"gmlx_lab.{name}")


def mlx_lm_patches(path: Path) -> list[str]:
    """What a module changes in mlx-lm: assignments to, or setattr on, a name bound to an mlx_lm module."""
    tree = ast.parse(path.read_text())
    bound = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
             if a.name.startswith("mlx_lm")}
    bound |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
              and (n.module or "").startswith("mlx_lm") for a in n.names}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        found += [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute) and ast.unparse(t.value) in bound]
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and ast.unparse(node.args[0]) in bound:
            found.append(ast.unparse(node))
    return found


def test_mlx_lm_is_changed_from_one_module() -> None:
    """gmlx_lab/mlx_lm_hooks.py is the one module that changes mlx-lm (installed from gmlx_lab/__init__)."""
    patching = {module_name(p): found for p in PACKAGE.rglob("*.py") if (found := mlx_lm_patches(p))}
    assert set(patching) == {"gmlx_lab.mlx_lm_hooks"}, patching
    assert "mlx_lm_hooks.install(" in (PACKAGE / "__init__.py").read_text()


def test_the_published_results_ship_with_the_package() -> None:
    """The notebooks read the committed results through viz.benchmark_results, from inside the package (a link to
    benchmarks/results in a checkout), and pyproject.toml's package data takes every one of them into an install."""
    import fnmatch

    from gmlx_lab.viz import published as sources

    root = PACKAGE.parent
    assert sources.RESULTS_DIR == PACKAGE / "data" / "results"
    assert sources.RESULTS_DIR.resolve() == root / "benchmarks" / "results"
    line = re.search(r"^gmlx_lab = \[(.*?)\]$", (root / "pyproject.toml").read_text(), re.M | re.S).group(1)
    patterns = re.findall(r'"([^"]+)"', line)
    files = sorted(sources.RESULTS_DIR.glob("*.json"))
    assert files and set(sources.benchmark_results()) == {f.name for f in files}
    unshipped = [f.name for f in files if not any(fnmatch.fnmatch(f"data/results/{f.name}", p) for p in patterns)]
    assert not unshipped


def test_result_files_are_named_by_machine() -> None:
    """Every committed result says where it ran at the end of its name, as gmlx_lab.doctor.machine_tag gives it
    (-cpu: MLX's CPU backend; -h200: the NVIDIA H200; -h100-80gb-hbm3: the NVIDIA H100; -apple-...: a Mac), in
    subfolders too (benchmarks/field.py's pieces under field/)."""
    results = PACKAGE.parent / "benchmarks" / "results"
    named = re.compile(r".*-(cpu|h200|h100-80gb-hbm3|apple-[a-z0-9-]+)")
    assert [str(p.relative_to(results)) for p in results.rglob("*.json") if not named.fullmatch(p.stem)] == []


def test_the_docs_the_code_cites_exist() -> None:
    """Every `docs/NAME.md` the package cites exists, and a cited `section N` is one of its `## N.` headings."""
    cited = set()
    for path in PACKAGE.rglob("*.py"):
        cited |= set(re.findall(r"docs/([\w.-]+\.md)(?: section (\d+))?", path.read_text()))
    assert cited
    for name, section in sorted(cited):
        doc = PACKAGE.parent / "docs" / name
        assert doc.is_file(), f"docs/{name} is cited but missing"
        if section:
            assert re.search(rf"^## {section}\. ", doc.read_text(), re.M), f"docs/{name} has no section {section}"


def test_the_package_reads_at_most_three_environment_variables_each_in_the_readme() -> None:
    """gmlx_lab reads GMLX_* variables only where the README's table documents them, and no more than three."""
    import re

    root = Path(__file__).resolve().parents[1]
    read = set()
    for path in (root / "gmlx_lab").rglob("*.py"):
        text = path.read_text()
        read |= set(re.findall(r"os\.environ(?:\.get)?[\[(]\s*\"(GMLX_[A-Z_]+)\"", text))
        read |= {name for name in re.findall(r"\"(GMLX_[A-Z_]+)\"", text)
                 if re.search(rf"\w+ = \"{name}\"", text)}  # a module constant naming a variable it reads
    readme = (root / "README.md").read_text()
    documented = set(re.findall(r"^\| `(GMLX_[A-Z_]+)` \|", readme, re.MULTILINE))
    assert read and read <= documented, f"read but not in the README's table: {sorted(read - documented)}"
    assert len(documented) <= 3, f"more than three variables: {sorted(documented)}"


def test_a_built_in_scheme_is_one_module() -> None:
    """Each built-in scheme's cache class and registry entry live in one module: gmlx_lab/cache/<name>.py, or
    <name>/cache.py for a scheme with kernels (its folder also holds its format); the registry's order is the
    modules' (fp16 first, then by name); there is no second list of schemes."""
    from gmlx_lab.cache import SHARED, scheme_modules
    from gmlx_lab.registry import SCHEMES

    modules = scheme_modules()
    assert modules[0] == "fp16" and modules[1:] == sorted(modules[1:])
    assert not set(modules) & set(SHARED)
    built_in = [s for s in SCHEMES.values()
                if s.cache_class is not None and s.cache_class.__module__.startswith("gmlx_lab.")]
    for scheme in built_in:
        module = scheme.cache_class.__module__.removeprefix("gmlx_lab.cache.")
        assert module in modules, scheme.name
        registered_in = type(scheme).__module__.removeprefix("gmlx_lab.cache.")
        assert registered_in == module, f"{scheme.name}: entry in {registered_in}, cache in {module}"
    order = list(dict.fromkeys(s.cache_class.__module__.removeprefix("gmlx_lab.cache.") for s in built_in))
    assert order == modules


def test_a_cache_and_its_scheme_share_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in cache built by hand and its scheme built by name agree on every option the class holds."""
    from gmlx_lab.registry import SCHEMES

    monkeypatch.delenv("GMLX_KVARN_BITS", raising=False)
    for scheme in SCHEMES.values():
        cls = scheme.cache_class
        if cls is None or not cls.__module__.startswith("gmlx_lab.") or not getattr(cls, "OPTIONS", ()):
            continue
        by_hand, by_name = cls(), scheme.make_cache(scheme.resolve())
        for option in cls.OPTIONS:
            assert getattr(by_hand, option.name) == getattr(by_name, option.name), (scheme.name, option.name)
        assert by_hand.options == by_name.options, scheme.name


def test_no_cache_asks_the_registry_about_itself() -> None:
    """A cache module checks its options against its own class (`OPTIONS`): nothing under cache/ looks schemes up
    in the registry, bar the package that imports them."""
    cache = PACKAGE / "cache"
    for path in sorted(cache.rglob("*.py")):
        if path == cache / "__init__.py":
            continue
        names = {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}
        names |= {a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)
                  for a in n.names}
        assert not names & {"SCHEMES", "get_scheme"}, path.relative_to(PACKAGE)


# -- bases a reader can hold in mind -------------------------------------------------------------------------------

MAX_METHODS = 25  # methods (properties included) a class defines itself
MAX_DEPTH = 4  # levels of cache classes below mlx-lm's _BaseCache


def _cache_classes() -> list[type]:
    import gmlx_lab.cache as cache_package
    from gmlx_lab.registry import SCHEMES

    found = {cache_package.GmlxCache, cache_package.BlockCache}
    found |= {s.cache_class for s in SCHEMES.values() if s.cache_class is not None}
    found |= {base for cls in list(found) for base in cls.__mro__ if base.__module__.startswith("gmlx_lab.")}
    return sorted(found, key=lambda c: (c.__module__, c.__name__))


def _own_methods(cls: type) -> list[str]:
    return [name for name, value in vars(cls).items()
            if callable(value) or isinstance(value, (property, classmethod, staticmethod))]


def test_no_class_of_the_caches_is_too_big_or_too_deep() -> None:
    """A cache class (and each mixin it takes) defines at most MAX_METHODS methods, and sits at most MAX_DEPTH
    levels below mlx-lm's _BaseCache (mlx-lm's own caches are two levels deep)."""
    from mlx_lm.models.cache import _BaseCache

    def depth(cls: type) -> int:
        return 0 if cls is _BaseCache else 1 + max(depth(b) for b in cls.__bases__ if issubclass(b, _BaseCache))

    classes = _cache_classes()
    assert len(classes) >= 10
    big = {c.__name__: len(_own_methods(c)) for c in classes if len(_own_methods(c)) > MAX_METHODS}
    assert not big, f"classes over {MAX_METHODS} methods: {big}"
    deep = {c.__name__: depth(c) for c in classes if issubclass(c, _BaseCache) and depth(c) > MAX_DEPTH}
    assert not deep, f"classes more than {MAX_DEPTH} levels below _BaseCache: {deep}"


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph.get(module, ())
    return seen


def test_a_pure_mlx_scheme_imports_no_kernel_module() -> None:
    """A scheme without fused kernels (no `KERNELS`) never loads the kernel layer: its module's imports, followed
    through gmlx_lab, reach no gmlx_lab.kernels module (only KernelRoute, which schemes with kernels inherit, does)."""
    from gmlx_lab.registry import SCHEMES

    graph = import_graph()
    ours = [s.cache_class for s in SCHEMES.values()
            if s.cache_class is not None and s.cache_class.__module__.startswith("gmlx_lab.")]
    pure = {cls.__module__ for cls in ours if not cls.KERNELS}
    assert "gmlx_lab.cache.fp16" in pure
    for module in pure:
        reached = sorted(m for m in _closure(graph, module) if m.startswith("gmlx_lab.kernels"))
        assert not reached, f"{module} reaches {reached}"
    fused = ("gmlx_lab.cache.kvarn.cache", "gmlx_lab.cache.kivi", "gmlx_lab.cache.turboquant", "gmlx_lab.cache.float")
    for module in fused:
        assert any(m.startswith("gmlx_lab.kernels") for m in _closure(graph, module)), module


def test_kvarn_reads_end_to_end_in_at_most_eight_files() -> None:
    """To read kvarn end to end a reader opens its own modules (the record format, the cache with its registry
    entry, its kernels' launch code) and the module of every class its cache and registry entry build on; the
    kernel bodies and the shared build/launch layer (kernels/build.py, splits.py) aside."""
    from gmlx_lab.cache import KvarnCache
    from gmlx_lab.registry import get_scheme

    own = {"gmlx_lab.cache.kvarn.records", "gmlx_lab.cache.kvarn.cache", "gmlx_lab.kernels.kvarn"}
    bases = {c.__module__ for cls in (KvarnCache, type(get_scheme("kvarn"))) for c in cls.__mro__
             if c.__module__.startswith("gmlx_lab.")}
    files = own | bases
    assert len(files) <= 8, sorted(files)
