"""The scheme registry: one place that names every cache scheme, its options and defaults.

`make_cache`, the policy, the command line, the widgets and the tests all read
`SCHEMES`; adding a scheme means adding one `Scheme` here and one cache class.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

KVARN_HEAD_DIMS = (128, 256, 512)  # gmlx's: whole 128-channel record slices
KVARN_EXT_HEAD_DIMS = (64, 96)  # the head-dim extension (option head_dim_ext=1): records of 128 tokens x the head
KVARN_BITS_ENV = "GMLX_KVARN_BITS"


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


@dataclass(frozen=True)
class Scheme:
    """A named way to store a layer's K/V cache, with its options."""

    name: str
    summary: str
    options: tuple[Option, ...] = field(default_factory=tuple)

    def option(self, name: str) -> Option:
        for opt in self.options:
            if opt.name == name:
                return opt
        raise KeyError(name)

    def defaults(self) -> dict[str, Any]:
        return {opt.name: opt.default for opt in self.options}

    def resolve(self, **given: Any) -> dict[str, Any]:
        """Fill defaults, check every value, and apply scheme-specific rules."""
        known = {opt.name for opt in self.options}
        unknown = sorted(set(given) - known)
        if unknown:
            accepted = ", ".join(sorted(known)) or "none"
            raise ValueError(f"{self.name}: unknown option(s) {unknown}; accepted options: {accepted}")
        values = self.defaults()
        for key, value in given.items():
            if value is not None:
                values[key] = value
        if self.name == "kvarn":
            values = _resolve_kvarn_widths(values, given)
        for opt in self.options:
            if values[opt.name] is not None:
                values[opt.name] = opt.check(values[opt.name], self.name)
        return values

    def check(self, where: str, **values: Any) -> None:
        """Check option values given to a cache constructor (no defaults, no environment), naming `where`."""
        for key, value in values.items():
            try:
                self.option(key).check(value, self.name)
            except KeyError:
                raise ValueError(f"{where}: {self.name} has no option {key!r}") from None
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None

    def label(self, values: dict[str, Any]) -> str:
        """Short name such as `fp16`, `affine8 g64` or `kvarn k6v5 tail=1024`."""
        if self.name == "fp16":
            return "fp16"
        if self.name in ("affine", "affine_rot"):
            return f"{self.name}{values['bits']} g{values['group_size']}"
        kb, vb = values["k_bits"], values["v_bits"]
        width = f"{kb}" if kb == vb else f" k{kb}v{vb}"
        ext = " ext" if values.get("head_dim_ext") else ""  # the head-dim extension (64/96)
        return f"kvarn{width} tail={values['kv_tail_tokens']}{ext}"


AFFINE_BITS = (2, 3, 4, 6, 8)
KVARN_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)

_AFFINE_OPTIONS = (
    Option("bits", 8, "code width in bits", AFFINE_BITS),
    Option("group_size", 64, "values per group sharing one fp16 scale and offset", GROUP_SIZES),
    Option("quantized_kv_start", 0, "keep fp16 until the context reaches this many tokens"),
)

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("fp16", "K and V stored as float16 (the baseline)"),
        Scheme(
            "affine",
            "mlx-lm's grouped affine quantization of each token's K/V row (--kv-bits)",
            _AFFINE_OPTIONS,
        ),
        Scheme(
            "affine_rot",
            "affine after a per-head Hadamard rotation (llama.cpp's attention rotation)",
            _AFFINE_OPTIONS,
        ),
        Scheme(
            "kvarn",
            "Hadamard rotation + variance-normalized 128x128 records, fp16 sink and tail (KVarN)",
            (
                Option("bits", 6, "code width for K and V", KVARN_BITS),
                Option("k_bits", None, "code width for K (default: bits)", KVARN_BITS),
                Option("v_bits", None, "code width for V (default: bits)", KVARN_BITS),
                Option("kv_tail_tokens", 1024, "newest tokens kept in fp16"),
                Option("norm_iters", 16, "variance-normalization rounds per record", minimum=0),
                Option("head_dim_ext", 0, "1: also head dims 64 and 96, records of 128 tokens by the whole head "
                       "(outside gmlx's format; gmlx declines such layers)", (0, 1)),
            ),
        ),
    )
}


def get_scheme(name: str) -> Scheme:
    """Look a scheme up by name, or raise a ValueError listing the known ones."""
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; accepted: {', '.join(SCHEMES)}")
    return SCHEMES[name]


def parse_kvarn_bits(text: str) -> tuple[int, int]:
    """Parse a GMLX_KVARN_BITS value: "6" (both) or "k6v5" (K then V)."""
    match = re.fullmatch(r"\s*(?:(\d+)|k(\d+)v(\d+))\s*", text or "")
    if not match:
        raise ValueError(
            f"{KVARN_BITS_ENV}={text!r} is malformed; expected a width such as '6' "
            f"or K and V widths such as 'k6v5' (widths: {', '.join(map(str, KVARN_BITS))})"
        )
    if match.group(1):
        kb = vb = int(match.group(1))
    else:
        kb, vb = int(match.group(2)), int(match.group(3))
    for which, b in (("K", kb), ("V", vb)):
        if b not in KVARN_BITS:
            raise ValueError(
                f"{KVARN_BITS_ENV}={text!r}: {which} width {b} is not supported; "
                f"accepted: {', '.join(map(str, KVARN_BITS))}"
            )
    return kb, vb


def _resolve_kvarn_widths(values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """K/V widths: explicit k_bits/v_bits, else bits; GMLX_KVARN_BITS overrides both."""
    env = os.environ.get(KVARN_BITS_ENV)
    if env is not None and env.strip() != "":
        kb, vb = parse_kvarn_bits(env)
    else:
        kb = values["k_bits"] if values["k_bits"] is not None else values["bits"]
        vb = values["v_bits"] if values["v_bits"] is not None else values["bits"]
    return {**values, "k_bits": kb, "v_bits": vb}
