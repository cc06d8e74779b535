"""Where gmlx_lab's files live: the user cache (converted models, compiled kernels) and the committed results."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$GMLX_LAB_CACHE, else $XDG_CACHE_HOME/gmlx_lab, else ~/.cache/gmlx_lab (read at each call)."""
    if os.environ.get("GMLX_LAB_CACHE"):
        return Path(os.environ["GMLX_LAB_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "gmlx_lab"


# The committed results: benchmarks/results/ in a checkout (gmlx_lab/data/results links to it), package data in an
# installed gmlx_lab (pyproject.toml), so the notebooks find them either way.
RESULTS_DIR = Path(__file__).resolve().parent / "data" / "results"
