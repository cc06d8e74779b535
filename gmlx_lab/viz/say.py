"""Narrative built from a run's values: how a notebook states a measured number.

    say(f"At {bits} bits kvarn's median KL is {num(kl)}, {'below' if kl < ref else 'above'} affine's.")

A notebook's Markdown cells state no measured number (tests/test_notebook_text.py checks); a sentence that needs
one is a code cell's output built from the computed value, so the text and the run cannot disagree.
"""

from __future__ import annotations

__all__ = ["Say", "answer", "say"]


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
