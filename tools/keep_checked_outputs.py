"""Run notebooks and save only the outputs nbval checks: the cells that start with `# NBVAL_CHECK_OUTPUT`.

    python tools/keep_checked_outputs.py notebooks/12_which_scheme_when.ipynb [more.ipynb ...]

CONTRIBUTING.md's rule: a checked cell keeps its text output (and its execution count, which nbval's own run
numbers alike), every other cell is saved without outputs. Run this after a change that moves a checked cell's
output, look at the diff, and commit it with the change.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

from gmlx_lab.book.run import execute
from gmlx_lab.book.site import NBVAL_MARK as CHECKED


def keep_checked(path: Path) -> int:
    """Run `path` and write it back with the checked cells' outputs only; returns how many cells it kept."""
    ran = execute(path).nb
    nb = nbformat.read(path, as_version=4)
    kept = 0
    for mine, done in zip(nb.cells, ran.cells):
        if mine.cell_type != "code":
            continue
        if mine.source.startswith(CHECKED):
            mine.outputs = [o for o in done.outputs if o.output_type == "stream"]
            mine.execution_count = done.execution_count
            kept += 1
        else:
            mine.outputs, mine.execution_count = [], None
    nbformat.write(nb, path)
    return kept


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for name in argv:
        print(f"{name}: kept {keep_checked(Path(name))} checked cells")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
