"""The fused kernels' settings: one object, chosen by explicit arguments or else by the environment.

`current()` is what the decode paths read (a cached `KernelConfig`); `configured(...)` sets fields for a block
(benchmarks' probes, tests) and `set_config(...)` for the process. An explicit setting always beats the
environment, which is read once, at the first `current()` (never at import), and only for the fields below;
`environment_choices()` names the settings the environment made, so the policy's [kv] line can say so.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

RING_CHOICES = ("auto", "on", "off")
FP16_PER_WARP_CHOICES = ("one", "as-records")
CHOICES = {"ring": RING_CHOICES, "fp16_per_warp": FP16_PER_WARP_CHOICES}  # settings that take one of some words


@dataclass(frozen=True)
class KernelConfig:
    """How the fused decode kernels run on a GPU (the CPU's reference path reads none of it)."""

    compile_graphs: bool = True  # decode attention replays one mx.compile graph per launch geometry (build.run_graph)
    ring: str = "auto"  # kvarn_decode stages code words through its cp.async ring: "on", "off", "auto" (long contexts)
    merge_in_kernel: bool = True  # CUDA: the split kernels merge their own splits (one launch a layer)
    kernel_cache: bool = True  # CUDA: kernels compiled once per machine, kept on disk (precompiled.py)
    # kvarn_decode's fp16 units (sink, recent tiles) a warp: "one", or "as-records" (as many as a warp's records)
    fp16_per_warp: str = "one"


ENVIRONMENT = {"compile_graphs": "GMLX_COMPILE_DECODE", "ring": "GMLX_KVARN_RING",
               "merge_in_kernel": "GMLX_MERGE_IN_KERNEL", "kernel_cache": "GMLX_KERNEL_CACHE",
               "fp16_per_warp": "GMLX_KVARN_FP16_PER_WARP"}
FLAGS = {"1": True, "0": False}


def parse(field: str, value: Any, source: str | None = None) -> Any:
    """A setting's value checked (and read from text for the environment); `source` names where it came from."""
    where = source or field
    if field in CHOICES:
        if value not in CHOICES[field]:
            raise ValueError(f"{where}={value!r}; accepted: {', '.join(CHOICES[field])}")
        return value
    if field not in ENVIRONMENT:
        raise ValueError(f"no kernel setting {field!r}; settings: {', '.join(ENVIRONMENT)}")
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip() in FLAGS:
        return FLAGS[value.strip()]
    raise ValueError(f"{where}={value!r}; accepted: True/False (environment: 1 or 0)")


def from_environment(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The settings the environment gives (only those set), checked."""
    return {f: parse(f, environ[name], name) for f, name in ENVIRONMENT.items() if name in environ}


_environment: dict[str, Any] | None = None  # read at the first current()
_environment_text: dict[str, str] = {}  # field -> "VARIABLE=value" as it was read
_explicit: list[dict[str, Any]] = [{}]  # set_config's settings, then those of each open configured() block
_resolved: KernelConfig | None = None


def current() -> KernelConfig:
    """The settings in force: the defaults, then the environment's, then explicit ones (innermost last)."""
    global _environment, _resolved
    if _resolved is None:
        if _environment is None:
            _environment = from_environment()
            _environment_text.clear()
            _environment_text.update({f: f"{ENVIRONMENT[f]}={os.environ[ENVIRONMENT[f]]}" for f in _environment})
        merged = {**_environment}
        for layer in _explicit:
            merged.update(layer)
        _resolved = KernelConfig(**merged)
    return _resolved


def _checked(settings: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(KernelConfig)}
    unknown = set(settings) - names
    if unknown:
        raise ValueError(f"no kernel setting {', '.join(sorted(unknown))}; settings: {', '.join(sorted(names))}")
    return {k: parse(k, v) for k, v in settings.items()}


def set_config(**settings: Any) -> KernelConfig:
    """Set fields for the rest of the process (explicit: they beat the environment); returns the settings."""
    global _resolved
    _explicit[0].update(_checked(settings))
    _resolved = None
    return current()


@contextmanager
def configured(**settings: Any) -> Iterator[KernelConfig]:
    """Within this block the given fields hold (explicit: they beat the environment and outer blocks)."""
    global _resolved
    _explicit.append(_checked(settings))
    _resolved = None
    try:
        yield current()
    finally:
        _explicit.pop()
        _resolved = None


def environment_choices() -> dict[str, str]:
    """`{field: "VARIABLE=value"}` for each setting in force that the environment chose (no explicit one beat it)."""
    current()
    explicit = {k for layer in _explicit for k in layer}
    return {f: text for f, text in _environment_text.items() if f not in explicit}


def reload_environment() -> KernelConfig:
    """Read the environment again (tests that set variables; a notebook after changing os.environ)."""
    global _environment, _resolved
    _environment, _resolved = None, None
    return current()


def as_dict() -> dict[str, Any]:
    """The settings in force, for a benchmark's JSON, with which of them the environment chose."""
    return {**{f.name: getattr(current(), f.name) for f in fields(KernelConfig)},
            "from_environment": sorted(environment_choices().values())}


