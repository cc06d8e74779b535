"""A notebook states no measured number it did not compute: the rule of `gmlx_lab/viz/say.py`, on every notebook.

A Markdown cell, and any string a code cell writes out, may not hold a measured number: a decimal (3.11, 1.4e-4),
a percentage (99.6%), a ratio (1.3x, 0.97x, "64 times"), a time (45 µs, 272 s) or a count of outcomes ("7 of 9",
"6/6"). Such a sentence belongs in a code cell's output, built from the computed value with `viz.say(...)`.

A number passes when its sentence
- names its outside source: a paper's author and year ("Liu et al., 2024") or arXiv id, a pull request or issue
  ("PR #21038"), gmlx's documentation, or a committed results file (`benchmarks/results/NAME.json`) that exists
  and records its machine;
- or shows it is a definition: it is the value of an arithmetic expression beside it ("2.83 (= 8/√8)",
  "(2048 × 4 + 768) × 8 / 16384 = 4.375 bits"), checked by evaluating the expression;
- or it is a parameter: the notebook's code writes that number as a literal (the input `np.full(8, 0.1)` makes
  "0.1 everywhere" a parameter). A count "N of M layers/heads/channels/..." is the model's structure, not an
  outcome.
Code spans (in backticks) that are expressions, calls or assignments are code, not claims; a bare number in
backticks is still a number. Integers without a unit are exact counts and sizes (tokens, bytes, bits) and pass.

Run one notebook: `pytest tests/test_notebook_text.py -k 04`. Each finding names the cell, the number and its
sentence.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# -- sources -----------------------------------------------------------------------------------------------

_YEAR = r"(?:19[5-9]\d|20[0-4]\d)"
_AUTHOR_YEAR = re.compile(rf"\b[A-Z][\w'’-]+ (?:et al\.?|and [A-Z][\w'’-]+),? \(?{_YEAR}\b"  # Liu et al., 2024
                          rf"|\([A-Z][\w'’-]+,? {_YEAR}\)|\b[A-Z][\w'’-]+ \({_YEAR}\)")  # (Liu, 2024), Liu (2024)
_ARXIV = re.compile(r"\barXiv[: ]\s*\d{4}\.\d{4,5}(?:v\d+)?", re.IGNORECASE)
_PR = re.compile(r"\b(?:PR|pull request|issue)\s*#\d+|\b[\w.-]+/[\w.-]+#\d+", re.IGNORECASE)
_GMLX_DOCS = re.compile(r"\bgmlx(?:'s|’s)? (?:documentation|docs)\b", re.IGNORECASE)
_RESULT_FILE = re.compile(r"benchmarks/results/[\w.*/-]+\.json")


@cache
def _records_machine(pattern: str) -> bool:
    """A results path (a glob is allowed) names committed files, each recording the machine it ran on."""
    paths = sorted(ROOT.glob(pattern))

    def has_machine(node, depth: int = 0) -> bool:
        if isinstance(node, dict):
            return bool({"machine", "device"} & set(node)) or (
                depth < 2 and all(has_machine(v, depth + 1) for v in node.values() if isinstance(v, dict))
                and any(isinstance(v, dict) for v in node.values()))
        return False

    return bool(paths) and all(has_machine(json.loads(p.read_text())) for p in paths)


def names_a_source(sentence: str) -> bool:
    """The sentence names where its numbers come from (see the module docstring)."""
    if _AUTHOR_YEAR.search(sentence) or _ARXIV.search(sentence) or _PR.search(sentence):
        return True
    if _GMLX_DOCS.search(sentence):
        return True
    return any(_records_machine(m.group(0)) for m in _RESULT_FILE.finditer(sentence))


# -- sentences ---------------------------------------------------------------------------------------------

_ABBREV = r"(?<!e\.g\.)(?<!i\.e\.)(?<!et al\.)(?<!\bvs\.)(?<!\bcf\.)"
_SENTENCE_END = re.compile(_ABBREV + r"(?<=[.!?])\s+(?=[A-Z*_`(\[\"“])")
_BLOCK_START = re.compile(r"^\s*(?:[-*+]\s|\d+[.)]\s|#|\||>)")


def sentences(markdown: str) -> list[str]:
    """Paragraphs, list items, table rows and headings, each cut at its sentence ends; fenced code is dropped."""
    markdown = re.sub(r"```.*?```", " ", markdown, flags=re.DOTALL)
    markdown = re.sub(r"<!--.*?-->", " ", markdown, flags=re.DOTALL)
    blocks: list[list[str]] = []
    for line in markdown.splitlines():
        if not line.strip():
            blocks.append([])
        elif _BLOCK_START.match(line) or not blocks:
            blocks.append([line])
        else:
            blocks[-1].append(line)
    out = []
    for block in blocks:
        text = " ".join(s.strip() for s in block).strip()
        out += [s for s in _SENTENCE_END.split(text) if s.strip()]
    return out


# -- numbers -----------------------------------------------------------------------------------------------

_NUM = r"\d+(?:\.\d+)?(?:[eE][-+−]?\d+)?"
_TIME = r"µs|us|ms|s|sec|secs|seconds?|minutes?|mins?|hours?|h|tok/s|tokens/s"
_UNIT = rf"\s?%|\s?[x×](?!\s*\d)(?!\w)|\s+times\b|\s?(?:{_TIME})(?![\w/])"
_TOKEN = re.compile(
    rf"(?<![\w.#§/])(?<!\w-)(?<!\d[-–])(?P<a>{_NUM})(?:\s?[-–]\s?(?P<b>{_NUM}))?(?!\.?\d)"
    rf"(?P<unit>{_UNIT})?")
_CHAIN = re.compile(rf"(?:(?<![\w.])({_NUM})\s*(?:,|\+|against|and|to|or|vs\.?)\s*)+$")
_RATIO_PREFIX = re.compile(rf"(?<![\w.])[x×](?P<a>{_NUM})(?!\.?\d)")
_N_OF_M = re.compile(r"(?<![\w./])(\d+) (?:of|out of) (?:the |their |its )?(\d+)\b(?:[\s-]+([a-zA-Z]+))?")
_SLASH = re.compile(r"(?<![\w./])(\d+)/(\d+)(?![\w/]|\.\d)")
_NAMES = re.compile(r"\b[A-Za-z][\w]*(?:[-.][\w]+)+")  # Llama-3.1-8B, Qwen3.8-27B, gemma3-270m, mma.m16n8k16
_URL = re.compile(r"https?://\S+")
_CODE_SPAN = re.compile(r"`([^`]*)`")
_OPERATOR = re.compile(r"[=+*×·/÷^√(<>]|\s[-−]\s|\w\s*\(")
_STRUCTURE = {"layer", "layers", "head", "heads", "channel", "channels", "group", "groups", "entry", "entries",
              "stage", "stages", "bit", "bits", "record", "records", "level", "levels", "row", "rows", "column",
              "columns", "value", "values", "token", "tokens", "cache", "caches", "family", "families", "notebook",
              "notebooks", "kind", "kinds"}
_EXPR_CHARS = r"[\d\s.+\-−×*·/÷^√()]"
_EQ_AFTER = re.compile(rf"^\s*\(?\s*(?:=|≈)\s*(?P<e>{_EXPR_CHARS}+)")
_EQ_BEFORE = re.compile(rf"(?P<e>{_EXPR_CHARS}+?)\s*=\s*[±]?$")


def _evaluate(expr: str) -> float | None:
    """The value of a plain arithmetic expression (digits, + − × · / ÷ ^ √, parentheses), or None."""
    text = expr.strip().rstrip("(.").strip()
    while text.endswith(")") and text.count(")") > text.count("("):
        text = text[:-1].rstrip()
    text = text.replace("−", "-").replace("×", "*").replace("·", "*").replace("÷", "/").replace("^", "**")
    text = re.sub(r"√\s*(\d+(?:\.\d+)?|\([^()]*\))", r"sqrt(\1)", text)
    if not re.search(r"\d", text) or not re.fullmatch(r"[\d\s.+\-*/()sqrt]+", text):
        return None
    while text.count("(") > text.count(")") and text.startswith("("):
        text = text[1:]
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow,
               ast.USub, ast.UAdd, ast.Call, ast.Name, ast.Load)
    if not all(isinstance(n, allowed) for n in ast.walk(tree)) or any(
            isinstance(n, ast.Name) and n.id != "sqrt" for n in ast.walk(tree)):
        return None
    try:
        return float(eval(compile(tree, "<expr>", "eval"), {"__builtins__": {}, "sqrt": math.sqrt}))
    except (ArithmeticError, ValueError, TypeError):
        return None


def _value(token: str) -> float:
    return float(token.replace("−", "-"))


def _close(printed: str, value: float | None) -> bool:
    """`value` rounds to `printed` (a decimal as written: 2.83 covers 2.825 to 2.835)."""
    if value is None:
        return False
    decimals = len(printed.split(".")[1].split("e")[0]) if "." in printed else 0
    return abs(_value(printed) - value) <= 0.5 * 10.0 ** -decimals + 1e-12


def _is_definition(text: str, start: int, end: int, token: str) -> bool:
    """`token` (at text[start:end]) sits beside `= expression` whose value it is."""
    after, before = _EQ_AFTER.match(text[end:]), _EQ_BEFORE.search(text[:start])
    return any(m is not None and _close(token, _evaluate(m.group("e"))) for m in (after, before))


@dataclass(frozen=True)
class Finding:
    """A measured number written into a notebook: where, which, and the sentence around it."""

    cell: int
    where: str
    number: str
    sentence: str

    def __str__(self) -> str:
        short = self.sentence if len(self.sentence) < 160 else self.sentence[:157] + "..."
        return f"cell {self.cell} ({self.where}): {self.number!r} in: {short}"


def _scan_text(sentence: str) -> str:
    """The sentence as it is scanned: URLs and names removed, code spans that are code blanked, others unwrapped."""
    text = _URL.sub(" ", sentence)

    def span(m: re.Match) -> str:
        body = m.group(1)
        return " " * len(m.group(0)) if _OPERATOR.search(body) or "/" in body or "_" in body else f" {body} "

    text = _CODE_SPAN.sub(span, text)
    return _NAMES.sub(lambda m: m.group(0) if re.match(r"[x×]\d", m.group(0)) else " " * len(m.group(0)), text)


def measured_numbers(sentence: str, parameters: frozenset[float] = frozenset()) -> list[str]:
    """The measured-number tokens of one sentence that it neither sources nor defines (see the module docstring)."""
    if names_a_source(sentence):
        return []
    text = _scan_text(sentence)
    found: list[str] = []
    for m in _TOKEN.finditer(text):
        numbers = [n for n in (m.group("a"), m.group("b")) if n]
        unit = (m.group("unit") or "").strip()
        if not unit and not any("." in n or "e" in n.lower() for n in numbers):
            continue  # an integer without a unit: an exact count or size
        if _is_definition(text, m.start(), m.end(), numbers[-1]):
            continue
        scale = 0.01 if unit == "%" else 1.0
        if unit in ("", "%") and all(not _value(n).is_integer() and (_value(n) in parameters or round(
                _value(n) * scale, 12) in parameters) for n in numbers):
            continue  # a decimal the code writes: a parameter
        if unit:  # "94 against 54 + 4 µs": the numbers listed before a unit share it
            chain = _CHAIN.search(text[: m.start()])
            found += [f"{n} {unit}" for n in re.findall(_NUM, chain.group(0))] if chain else []
        found.append(m.group(0).strip())
    for m in _RATIO_PREFIX.finditer(text):
        if _value(m.group("a")) not in parameters:
            found.append(m.group(0))
    for m in _N_OF_M.finditer(text):
        if (m.group(3) or "").lower() not in _STRUCTURE:
            found.append(f"{m.group(1)} of {m.group(2)}")
    for m in _SLASH.finditer(text):
        around = text[max(0, m.start() - 3) : m.start()] + text[m.end() : m.end() + 3]
        if not re.search(r"[+\-−×*·=÷]", around):
            found.append(m.group(0))
    return found


# -- notebooks ---------------------------------------------------------------------------------------------


def _code_literals(sources: list[str]) -> frozenset[float]:
    """Every number written as a literal in the notebook's code: the parameters its text may repeat."""
    found: set[float] = set()
    for src in sources:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                    and not isinstance(node.value, bool):
                found.add(float(node.value))
    return frozenset(found)


def _code_strings(src: str) -> list[str]:
    """The text a code cell writes: its string literals (f-strings with `{}` for each value), docstrings left out."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return []
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    inside_fstring = {id(c) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for c in ast.walk(n)
                      if c is not n}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and id(node) not in inside_fstring:
            out.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and id(node) not in inside_fstring:
            out.append(node.value)
    return out


def notebook_findings(nb: nbformat.NotebookNode) -> list[Finding]:
    """Every measured number that a notebook's Markdown or its code's strings state without a source."""
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    parameters = _code_literals(code)
    findings = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            texts, where = [cell.source], "markdown"
        elif cell.cell_type == "code":
            texts, where = _code_strings(cell.source), "code string"
        else:
            continue
        for text in texts:
            for sentence in sentences(text):
                findings += [Finding(i, where, n, sentence) for n in measured_numbers(sentence, parameters)]
    return findings


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_states_no_measured_number(path: Path) -> None:
    findings = notebook_findings(nbformat.read(path, as_version=4))
    assert not findings, (
        f"{path.name} states {len(findings)} measured number(s) its run does not compute; build the sentence "
        "with viz.say(...) from the computed value, or name the source in the same sentence "
        "(tests/test_notebook_text.py says what passes):\n" + "\n".join(map(str, findings)))


# -- the checker, on small synthetic notebooks -----------------------------------------------------------------


def _notebook(*cells: tuple[str, str]) -> nbformat.NotebookNode:
    make = {"markdown": nbformat.v4.new_markdown_cell, "code": nbformat.v4.new_code_cell}
    return nbformat.v4.new_notebook(cells=[make[kind](source) for kind, source in cells])


def _numbers(markdown: str, code: str = "") -> list[str]:
    cells = [("markdown", markdown)] + ([("code", code)] if code else [])
    return [f.number for f in notebook_findings(_notebook(*cells))]


@pytest.mark.parametrize("text,caught", [
    ("At 4 bits kvarn's KL is 0.0137.", ["0.0137"]),
    ("It keeps 99.6% of the top-1 tokens.", ["99.6%"]),
    ("The fused kernel is 0.97x faster.", ["0.97x"]),
    ("kvarn4 is 1.3× smaller and 64 times closer.", ["1.3×", "64 times"]),
    ("kvarn recalls 7 of 9 keys, affine 6/6.", ["7 of 9", "6/6"]),
    ("The ring takes 45 µs at 8K.", ["45 µs"]),
    ("That merge cost 94 against 54 + 4 µs.", ["94 µs", "54 µs", "4 µs"]),
    ("The error fell 28-57% and then x0.24.", ["28-57%", "x0.24"]),
    ("KL 1.4e-4 against 2e-3.", ["1.4e-4", "2e-3"]),
    ("At 2048 tokens kvarn is 1.3x smaller (Table 2).", ["1.3x"]),  # a number that looks like a year is not one
])
def test_unsourced_measured_numbers_fail(text: str, caught: list[str]) -> None:
    assert sorted(_numbers(text)) == sorted(caught)


@pytest.mark.parametrize("text", [
    "KIVI (Liu et al., 2024) reports 2.6x less memory.",
    "TurboQuant (arXiv:2504.19874) keeps 99.5% at 3.5 bits.",
    "Perplexity rises from 7.32 to 7.50 at q4_0 (llama.cpp PR #21038).",
    "gmlx's documentation gives 0.00045 at 4 bits.",
    "On the H200 the ring took 45 µs (`benchmarks/results/decode_attention-ring-h200.json`).",
    "Full attention grows by 4 + 16/64 bits per value, in 128-token records of 4 bits, to 32K tokens.",
    "Every entry is ±2.83 (= 8/√8).",
    "A record costs (2048 × 4 + 768) × 8 / 16384 = 4.375 bits per value.",
    "Qwen3.8-27B, Llama-3.1-8B and gemma3-270m run on MLX 0.29.1 with mma.m16n8k16 tiles of 16x16.",
    "Only 2 of 18 layers quantize, 7 of their 8 heads.",
    "The even share is `viz.even_share(384, 128)` and the tail `kv_tail_tokens=128`.",
])
def test_sourced_defined_and_structural_numbers_pass(text: str) -> None:
    assert _numbers(text) == []


def test_a_wrong_definition_and_a_missing_file_do_not_pass() -> None:
    assert _numbers("Every entry is ±2.90 (= 8/√8).") == ["2.90"]
    assert _numbers("The ring took 45 µs (`benchmarks/results/no-such-run.json`).") == ["45 µs"]
    assert _numbers("The even share is `0.55`.") == ["0.55"]  # a bare number in backticks is still a number


def test_a_source_covers_its_own_sentence_only() -> None:
    text = "KIVI (Liu et al., 2024) reports 2.6x. Ours gives 3.1x."
    assert _numbers(text) == ["3.1x"]


def test_a_decimal_the_code_writes_is_a_parameter_an_integer_ratio_is_not() -> None:
    text = "The input is 0.1 everywhere; the step grows 12x."
    assert _numbers(text) == ["0.1", "12x"]
    assert _numbers(text, code="x = np.full(8, 0.1) + outlier(12)") == ["12x"]


def test_code_strings_are_read_and_computed_values_pass() -> None:
    nb = _notebook(("code", 'print("kvarn is 1.3x faster")\nviz.say(f"kvarn is {r:.2f}x faster, {share:.0%} of fp16")'),
                   ("code", 'def f():\n    """A docstring may say 0.5."""\n    return 0\n'))
    assert [(f.cell, f.where, f.number) for f in notebook_findings(nb)] == [(0, "code string", "1.3x")]


def test_sentences_split_at_ends_but_not_inside_numbers_or_abbreviations() -> None:
    text = "One is 3.11, e.g. Two. Three (Liu et al. 2024) here.\n\n- a list item\n| a | table |"
    assert sentences(text) == ["One is 3.11, e.g. Two.", "Three (Liu et al. 2024) here.", "- a list item",
                               "| a | table |"]
