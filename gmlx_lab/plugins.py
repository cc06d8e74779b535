"""Loading plug-in schemes: a module that calls `gmlx_lab.register_scheme` when it is imported.

    gmlx-lab --plugin my_scheme fidelity --schemes affine4,mine4     # a module on sys.path or in the current folder
    gmlx-lab --plugin path/to/my_scheme.py memory --schemes mine4    # or a Python file
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_plugin"]


def load_plugin(name: str) -> ModuleType:
    """Import a plug-in by module name (from sys.path or the current folder) or by .py path; returns the module.

    Importing registers its schemes; a module imported before is not run again. Raises a ValueError saying
    what is accepted when it cannot be found.
    """
    path = Path(name)
    if name.endswith(".py") or path.is_file():
        return _load_file(path)
    cwd = str(Path.cwd())
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.split(".")[0] != exc.name.split(".")[0]:
            raise  # the plug-in itself imports something missing: its own error, with its traceback
        raise ValueError(f"cannot import plug-in {name!r} ({exc}); accepted: a module name importable from the "
                         "current folder or sys.path, or the path of a .py file") from None
    finally:
        if added:
            sys.path.remove(cwd)


def _load_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise ValueError(f"plug-in file {str(path)!r} not found; accepted: a module name or the path of a .py file")
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path.resolve():
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
