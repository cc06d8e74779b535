"""gmlx_lab's user cache folder: converted models and compiled kernels live under it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$GMLX_LAB_CACHE, else $XDG_CACHE_HOME/gmlx_lab, else ~/.cache/gmlx_lab (read at each call)."""
    if os.environ.get("GMLX_LAB_CACHE"):
        return Path(os.environ["GMLX_LAB_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "gmlx_lab"
