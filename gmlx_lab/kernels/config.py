"""The fused kernels' settings: one object, set only by explicit calls, never by the environment.

Each setting keeps the shipped behaviour by default and exists so tests and benchmarks can run the other path
the kernels must keep anyway: `ring` forces the cp.async ring on or off (it is chosen by the record count,
`decode.ring_for`), `merge_in_kernel` the split kernels' own merge (CUDA merges in the kernel, Metal cannot and
launches split_merge), `kernel_cache` the disk cache of compiled kernels (precompiled.py). `current()` is what
the decode paths read; `configured(...)` sets fields for a block, `set_config(...)` for the process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

RING_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class KernelConfig:
    """How the fused decode kernels run on a GPU (the CPU's reference path reads none of it)."""

    ring: str = "auto"  # kvarn_decode stages code words through its cp.async ring: "auto" (long contexts), "on", "off"
    merge_in_kernel: bool = True  # CUDA: the split kernels merge their own splits (one launch a layer)
    kernel_cache: bool = True  # CUDA: kernels compiled once per machine, kept on disk (precompiled.py)


def parse(field: str, value: Any) -> Any:
    """A setting's value, checked."""
    if field == "ring":
        if value not in RING_CHOICES:
            raise ValueError(f"ring={value!r}; accepted: {', '.join(RING_CHOICES)}")
        return value
    if not isinstance(value, bool):
        raise ValueError(f"{field}={value!r}; accepted: True or False")
    return value


_explicit: list[dict[str, Any]] = [{}]  # set_config's settings, then those of each open configured() block
_resolved: KernelConfig | None = None


def current() -> KernelConfig:
    """The settings in force: the defaults, then explicit ones (innermost last)."""
    global _resolved
    if _resolved is None:
        merged: dict[str, Any] = {}
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
    """Set fields for the rest of the process; returns the settings."""
    global _resolved
    _explicit[0].update(_checked(settings))
    _resolved = None
    return current()


@contextmanager
def configured(**settings: Any) -> Iterator[KernelConfig]:
    """Within this block the given fields hold (they beat outer blocks and set_config)."""
    global _resolved
    _explicit.append(_checked(settings))
    _resolved = None
    try:
        yield current()
    finally:
        _explicit.pop()
        _resolved = None


def as_dict() -> dict[str, Any]:
    """The settings in force, for a benchmark's JSON."""
    return {f.name: getattr(current(), f.name) for f in fields(KernelConfig)}
