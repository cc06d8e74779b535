"""Narrative built from a run's values: how a notebook states a measured number.

    say(f"At {bits} bits kvarn's median KL is {num(kl)}, {'below' if kl < ref else 'above'} affine's.")

A notebook's Markdown cells state no measured number (tests/test_notebook_text.py checks); a sentence that needs
one is a code cell's output built from the computed value, so the text and the run cannot disagree.
"""

from __future__ import annotations

import difflib
import re

__all__ = ["Say", "answer", "assembled_lists", "say"]


class Say:
    """Markdown text that displays as rendered Markdown in Jupyter and as plain text elsewhere."""

    def __init__(self, text: str):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"say() needs non-empty text, got {text!r}")
        self.text = text

    def _repr_markdown_(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text


def say(*paragraphs: str) -> Say:
    """Paragraphs of Markdown (already formatted from the run's values), shown as one output."""
    return Say("\n\n".join(paragraphs))


def answer(*paragraphs: str) -> Say:
    """A worked answer to a "Your turn" cell, computed in the run and folded (revealed on click), as the pages
    fold their other answers."""
    return Say("<details><summary><b>Answer</b> (click to open)</summary>\n\n" + "\n\n".join(paragraphs)
               + "\n\n</details>")


_NUMBER = re.compile(r"[-+]?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")
_BULLET = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
MAX_LIST_ITEMS = (2, 3)  # same-pattern items a text may hold as bullets, and inside one sentence


def _pattern(item: str) -> tuple[str, ...]:
    """An item's words, each word that holds a number as '#' ("kvarn4", "37.6%", "tail=128"): what stays when only
    the run's values and the schemes' widths change."""
    return tuple("#" if _NUMBER.search(word) else word for word in item.split())


def _alike(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Two items written from one template: three words or more and two numbers or more each (a list of names such
    as "affine4 g64, kvarn2 tail=128" is not a template), and most of their words the same."""
    if min(len(a), len(b)) < 3 or a.count("#") < 2 or b.count("#") < 2:
        return False
    return difflib.SequenceMatcher(a=a, b=b).ratio() >= 0.7


def _longest_run(items: list[str]) -> list[str]:
    """The longest stretch of consecutive items alike to the stretch's first."""
    best: list[str] = []
    for i in range(len(items)):
        run = [items[i]]
        for item in items[i + 1:]:
            if not _alike(_pattern(items[i]), _pattern(item)):
                break
            run.append(item)
        best = max(best, run, key=len)
    return best


def assembled_lists(text: str) -> list[str]:
    """Where Markdown reads as a log rather than prose, one finding each: more than MAX_LIST_ITEMS[0] bullets, or
    more than MAX_LIST_ITEMS[1] comma-separated parts of one sentence, written from one template with only the
    numbers changed ("kvarn2 (37.6%, KL 2.1e-03) beside ...", "0.96x at 2, 0.83x at 3, ..."). Such values belong
    in a table (`viz.Table`), and the prose around it says what they show."""
    found, bullets = [], []
    for line in text.splitlines() + [""]:
        if _BULLET.match(line):
            bullets.append(_BULLET.sub("", line))
        else:
            run = _longest_run(bullets)
            if len(run) > MAX_LIST_ITEMS[0]:
                found.append(f"{len(run)} bullets from one template: {run[0][:60]!r} ...")
            bullets = []
        for sentence in re.split(r"(?<=[.:;!?])\s+", line):
            run = _longest_run([part for part in re.split(r",\s+|\s+and\s+", sentence) if part])
            if len(run) > MAX_LIST_ITEMS[1]:
                found.append(f"{len(run)} parts of one sentence from one template: {', '.join(run)[:80]!r} ...")
    return found
