"""The scheme registry: every cache scheme as one `Scheme` object, looked up by name.

A `Scheme` carries everything the rest of gmlx_lab asks about a scheme: its options and defaults, its cache
factory, its label, its byte formula, its policy rule (which layers it can take), and what the audit, the
memory report, the quantization helpers and the widgets need. `make_cache`, the policy, the command line,
the figures, the widgets and the tests read only `SCHEMES`; none of them tests a scheme's name.

The built-in schemes live in `gmlx_lab/cache/` (one module each, a folder where a scheme has kernels) and register
themselves when gmlx_lab is imported; `register_scheme` adds one at run time (see `gmlx_lab/cache/block.py` for a
base that writes most of a scheme for you, and notebook 09).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .mlx_lm_hooks import register_cache_class, same_class

BASELINE = "fp16"  # the scheme every policy falls back to, and the reference of fidelity and memory


@dataclass(frozen=True)
class Option:
    """One option of a scheme: its default, and what values are accepted."""

    name: str
    default: Any
    help: str
    choices: tuple[int, ...] | None = None  # accepted values, or None for "an int >= minimum"
    minimum: int = 0

    def check(self, value: Any, scheme: str) -> int:
        """Return `value` as an int, or raise a ValueError naming what is accepted."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"{scheme}: option {self.name}={value!r} must be an int ({self.accepted()})"
            )
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{scheme}: {self.name}={value} is not supported; accepted: {self.accepted()}")
        if self.choices is None and value < self.minimum:
            raise ValueError(f"{scheme}: {self.name}={value} is not supported; accepted: {self.accepted()}")
        return value

    def accepted(self) -> str:
        if self.choices is not None:
            return ", ".join(str(c) for c in self.choices)
        return f"an int >= {self.minimum}"


Rules = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]  # (values, given) -> values


def check_options(options: tuple[Option, ...], values: Mapping[str, Any], scheme: str, where: str) -> None:
    """Each of `values` against its Option in `options` (no defaults, no rules), the error naming `where`."""
    known = {opt.name: opt for opt in options}
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"{where}: {scheme} has no option {key!r}")
        try:
            known[key].check(value, scheme)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None


def resolve_options(options: tuple[Option, ...], given: Mapping[str, Any], scheme: str, rules: Rules) -> dict[str, Any]:
    """The values of `options`: the defaults, the given ones (None: the default), the rules between options, then
    every value checked. The one resolution of a scheme's options, for the registry and for a cache built by hand."""
    known = {opt.name for opt in options}
    unknown = sorted(set(given) - known)
    if unknown:
        accepted = ", ".join(sorted(known)) or "none"
        raise ValueError(f"{scheme}: unknown option(s) {unknown}; accepted options: {accepted}")
    values = {opt.name: opt.default for opt in options}
    values.update({key: value for key, value in given.items() if value is not None})
    values = rules(values, dict(given))
    for opt in options:
        if values[opt.name] is not None:
            values[opt.name] = opt.check(values[opt.name], scheme)
    return values


@dataclass(frozen=True)
class Scheme:
    """A named way to store a layer's K/V cache. Subclass it and override what your scheme does differently.

    Every method has a default that fits a scheme whose options are named like the built-in ones (`bits`,
    `k_bits`/`v_bits`, `kv_tail_tokens`); `make_cache` builds `cache_class`; `layer_bytes` has none.
    """

    name: str
    summary: str
    options: tuple[Option, ...] = ()
    cache_class: type | None = None  # what make_cache returns: the audit checks it, save/load finds it by name
    color: str = "#7f7f7f"  # in the figures
    # option sets the generic tests run this scheme with (tests/schemes.py: every registered scheme, built-in or
    # plug-in, goes through the same matrix); none: its defaults
    examples: tuple[dict[str, Any], ...] = ()

    # -- options --------------------------------------------------------------------------------
    def option(self, name: str) -> Option:
        for opt in self.options:
            if opt.name == name:
                return opt
        raise KeyError(name)

    def defaults(self) -> dict[str, Any]:
        return {opt.name: opt.default for opt in self.options}

    def resolve(self, **given: Any) -> dict[str, Any]:
        """Fill defaults, apply the scheme's own rules (`adjust`), and check every value."""
        return resolve_options(self.options, given, self.name, self.adjust)

    def adjust(self, values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        """Rules between options (kvarn: K/V widths from `bits`, or the environment where no width is given);
        by default none."""
        return values

    def environment(self, given: dict[str, Any]) -> str:
        """What the environment chose for these options, in words ('' for nothing: the default). Explicit options
        always beat the environment (kvarn: GMLX_KVARN_BITS sets the widths that are not given)."""
        return ""

    # -- what the rest of gmlx_lab asks ---------------------------------------------------------------
    def make_cache(self, options: dict[str, Any], layer: int | None = None) -> Any:
        """One layer's cache, from options already resolved: by default its class, given them by name."""
        if self.cache_class is None:
            raise NotImplementedError(f"scheme {self.name} has no cache class")
        return self.cache_class(layer=layer, **options)

    def label(self, values: dict[str, Any]) -> str:
        """Short name such as `affine8 g64` or `kvarn k6v5 tail=1024`; by default name, width and tail."""
        label = self.name + _width(values)
        if "kv_tail_tokens" in values:
            label += f" tail={values['kv_tail_tokens']}"
        return label

    def spec_words(self) -> dict[str, dict[str, Any]]:
        """Words that name this scheme with options in a spec or label, beside its name ("mxfp4" -> float with
        bits 4, group_size 32); none by default."""
        return {}

    def bits(self, values: dict[str, Any]) -> int | dict[str, int] | None:
        """The code width for reports: an int, {"k": .., "v": ..} when K and V differ, or None."""
        if values.get("k_bits") is not None and values.get("v_bits") is not None:
            kb, vb = values["k_bits"], values["v_bits"]
            return kb if kb == vb else {"k": kb, "v": vb}
        return values.get("bits")

    def declines(self, kind: str, k_dim: int, v_dim: int, options: dict[str, Any]) -> str | None:
        """The policy rule: why a growing attention layer (`kind`, head dims) stays fp16, or None to take it.

        The shared rules (recurrent state, sliding windows, the last of a deep stack) are the policy's.
        """
        return None

    def reason_taken(self, kind: str, k_dim: int, v_dim: int, options: dict[str, Any]) -> str:
        """The reason recorded for a layer the scheme takes."""
        return "growing attention"

    def check_window(self, max_kv_size: int, options: dict[str, Any], where: str) -> None:
        """Refuse a rolling window (`max_kv_size`) this scheme's layers cannot roll: the rule is its cache's
        (`window_check`, e.g. the shared one of gmlx_lab/cache/window.py), asked of a fresh cache."""
        self.make_cache(options).window_check(max_kv_size, where)

    def token_region(self, position: int, tokens: int, newest: int, options: dict[str, Any]) -> str:
        """Where a cache of `tokens` tokens, whose latest update brought `newest`, holds the token at
        `position`: "quantized" unless the scheme keeps regions of its own (kvarn: sink, records, live, tail)."""
        return "quantized"

    def layer_bytes(self, tokens: int, kv_heads: int, k_dim: int, v_dim: int, options: dict[str, Any]) -> float:
        """Stored bytes of one layer (batch 1) holding `tokens` tokens, growth reserve excluded."""
        raise NotImplementedError(f"scheme {self.name} has no byte formula")

    def audit(self, cache: Any, options: dict[str, Any]) -> tuple[str, bool]:
        """(what is wrong with this cache of the scheme, '' if nothing; whether it should hold codes by now)."""
        return "", False

    def roundtrip(self, x: np.ndarray, kind: str, options: dict[str, Any]) -> np.ndarray:
        """`x` (tokens, head_dim) stored and read back the way the scheme's cache does (for error plots)."""
        raise NotImplementedError(f"scheme {self.name} has no roundtrip")


def _width(values: Mapping[str, Any]) -> str:
    kb, vb = values.get("k_bits"), values.get("v_bits")
    if kb is not None and vb is not None:
        return f"{kb}" if kb == vb else f" k{kb}v{vb}"
    return f"{values['bits']}" if values.get("bits") is not None else ""


SCHEMES: dict[str, Scheme] = {}


def register_scheme(scheme: Scheme, *, replace: bool = False) -> Scheme:
    """Add a scheme to the registry (and its cache class to mlx-lm's, so `load_prompt_cache` finds it).

    Registering the same definition again (a re-run notebook cell: same class name and module) replaces it;
    another scheme of a registered name is refused unless `replace=True`.
    """
    if not isinstance(scheme, Scheme):
        raise TypeError(f"register_scheme needs a gmlx_lab.registry.Scheme, got {type(scheme).__name__}")
    old = SCHEMES.get(scheme.name)
    if old is not None and not replace and not _same_definition(old, scheme):
        raise ValueError(f"scheme {scheme.name!r} is already registered ({type(old).__name__}); "
                         "pick another name or pass replace=True")
    if scheme.cache_class is not None:
        register_cache_class(scheme.cache_class)
    SCHEMES[scheme.name] = scheme
    return scheme


def _same_definition(old: Scheme, new: Scheme) -> bool:
    if type(old) is not type(new) and not same_class(type(old), type(new)):
        return False
    if old.cache_class is None or new.cache_class is None:
        return old.cache_class is new.cache_class
    return same_class(old.cache_class, new.cache_class)


def spec_prefixes() -> list[tuple[str, str, dict[str, Any]]]:
    """(word, scheme, options) for every scheme name and spec word (`Scheme.spec_words`), longest word first: the
    order in which a spec or a label is matched against them."""
    out = [(name, name, {}) for name in SCHEMES]
    out += [(word, s.name, dict(opts)) for s in SCHEMES.values() for word, opts in s.spec_words().items()]
    return sorted(out, key=lambda item: len(item[0]), reverse=True)


def get_scheme(name: str) -> Scheme:
    """Look a scheme up by name, or raise a ValueError listing the known ones."""
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; accepted: {', '.join(SCHEMES)}")
    return SCHEMES[name]
