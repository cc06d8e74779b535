"""Scheme specs: the short text that names a scheme and its options ("affine4", "kvarn6:tail=128", "kvarn:k8v4").

The command line, `fidelity`, `memory_report`, the tradeoff and the experiments all read schemes from specs;
this is the grammar's one home. The values are checked by the registry (`Scheme.resolve`), not here.
"""

from __future__ import annotations

import re
from typing import Any

import mlx.nn as nn

from .policy import Policy, policy
from .registry import SCHEMES, get_scheme, spec_prefixes

__all__ = ["SchemeLike", "parse_scheme_spec", "scheme_label", "spec_policy"]

_ALIASES = {"tail": "kv_tail_tokens", "g": "group_size", "group": "group_size", "iters": "norm_iters",
            "start": "quantized_kv_start", "k": "k_bits", "v": "v_bits", "ext": "head_dim_ext",
            "sink": "sink_tokens", "rot": "rotation"}
_SPLIT = re.compile(r"k(\d+)v(\d+)")

SchemeLike = str | tuple[str, dict[str, Any]] | Policy


def parse_scheme_spec(text: str | tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Read "fp16", "affine4", "affine_rot4:g=32", "kvarn6:tail=128" or "kvarn:k8v4" into (scheme, options).

    The name is the longest registered scheme name (or a scheme's spec word, "mxfp4": `Scheme.spec_words`, which
    sets options) the spec starts with; a number after it is `bits`, "k8v4"
    sets `k_bits` and `v_bits` (schemes that have them), "key=value" any option (short names in _ALIASES).
    Options are checked against the registry (gmlx_lab.registry.SCHEMES); anything it
    does not accept raises a ValueError saying what is accepted.
    """
    if isinstance(text, tuple):
        scheme, options = text
        get_scheme(scheme).resolve(**options)
        return scheme, dict(options)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"scheme spec must be a non-empty string such as 'kvarn6', got {text!r}")
    head, _, tail = text.strip().partition(":")
    word, name, options = next(((w, s, o) for w, s, o in spec_prefixes() if head.startswith(w)), ("", None, {}))
    if name is None:
        raise ValueError(f"unknown scheme in {text!r}; schemes: {', '.join(SCHEMES)} "
                         "(e.g. fp16, affine4, affine_rot4, kvarn6, kvarn6:tail=128, kvarn:k8v4)")
    spec = get_scheme(name)
    names = {opt.name for opt in spec.options}
    parts = [head[len(word):]] + [p for p in tail.split(",") if p.strip()]
    for part in (p.strip() for p in parts):
        if not part:
            continue
        if part.isdigit():
            options["bits"] = int(part)
        elif _SPLIT.fullmatch(part):
            if not {"k_bits", "v_bits"} <= names:
                split = [s.name for s in SCHEMES.values() if {"k_bits", "v_bits"} <= {o.name for o in s.options}]
                verb = "stores" if len(split) == 1 else "store"
                raise ValueError(f"{text!r}: only {', '.join(split) or 'no scheme'} {verb} K and V at different "
                                 f"widths; {name} has one 'bits' for both")
            kb, vb = _SPLIT.fullmatch(part).groups()
            options.update(k_bits=int(kb), v_bits=int(vb))
        elif "=" in part:
            key, _, value = (s.strip() for s in part.partition("="))
            if not re.fullmatch(r"-?\d+", value):
                raise ValueError(f"{text!r}: option {key}={value!r} must be an integer")
            options[_ALIASES.get(key, key)] = int(value)
        else:
            raise ValueError(f"cannot read {part!r} in {text!r}; expected a width (6), K/V widths (k8v4) "
                             "or options such as tail=128, g=64")
    if not names and options:
        raise ValueError(f"{text!r}: {name} takes no width or options")
    spec.resolve(**options)  # raises a ValueError naming what is accepted
    return name, options


def scheme_label(scheme: str, options: dict[str, Any]) -> str:
    """The registry's short label, e.g. `affine4 g64` or `kvarn k8v4 tail=128`."""
    spec = get_scheme(scheme)
    return spec.label(spec.resolve(**options))


def spec_policy(model: nn.Module, item: SchemeLike) -> tuple[str, Policy]:
    """(spec text, policy) for a spec string, a (scheme, options) pair or a ready Policy."""
    if isinstance(item, Policy):
        return item.label, item
    scheme, options = parse_scheme_spec(item)
    spec = item if isinstance(item, str) else scheme_label(scheme, options)
    return spec, policy(model, scheme, **options)
