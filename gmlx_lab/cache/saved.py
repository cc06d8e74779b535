"""A saved cache is an input: the checks a cache's `state` setter runs on what a prompt-cache file holds.

mlx-lm's `load_prompt_cache` rebuilds each cache with `cls.from_state(state)`, which sets `state`. The gmlx_lab
caches check there, before anything uses the cache: the layout version, the scalars' types and ranges, each
array's shape and dtype against the scheme's geometry and the stored offset, the regions against one another,
and (unless the caller says not to) that every value the cache holds is finite. Whatever is wrong raises one
`SavedCacheError` that names the layer, the item, what it holds and what was expected. `load_prompt_cache`
here reads the file as mlx-lm's does and adds the file's name and the cache's place in it; it also turns a
truncated or foreign file into that error. A deep copy rebuilds a live cache from its own state: `trusted()`
skips the checks there.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx.utils import tree_unflatten

__all__ = ["SavedCacheError", "StateReader", "checks_finite", "describe", "load_prompt_cache", "trusted"]

SHAPE_NAMES = ("batch", "kv heads", "key head_dim", "value head_dim")
_TRUSTED = contextvars.ContextVar("gmlx_lab_state_trusted", default=False)
_FINITE = contextvars.ContextVar("gmlx_lab_state_finite", default=True)


class SavedCacheError(ValueError):
    """A saved cache that does not hold what its class and geometry say it must."""


@contextlib.contextmanager
def trusted() -> Iterator[None]:
    """Within: `state` setters take the state as it is (a deep copy of a live cache, already checked)."""
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def is_trusted() -> bool:
    return _TRUSTED.get()


def checks_finite() -> bool:
    """Whether a state being loaded is scanned for inf/nan (True unless `load_prompt_cache(check_finite=False)`)."""
    return _FINITE.get()


def describe(x: Any) -> str:
    """What a saved item holds, for a message: an array's shape and dtype, else its type."""
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, mx.array) else type(x).__name__


class StateReader:
    """Reads one cache's state item by item, raising SavedCacheError with the layer and the item named."""

    def __init__(self, state: Any, cls: type, layout: str, fixed: int):
        self.cls = cls.__name__
        self.where = self.cls
        if not isinstance(state, (list, tuple)) or not state:
            raise SavedCacheError(f"{self.cls}: a saved state is a list of arrays and scalars, got "
                                  f"{type(state).__name__}")
        found = state[-1]
        if found != layout:
            said = repr(found) if isinstance(found, str) else "no layout version"
            raise SavedCacheError(f"{self.cls}: the file was saved in layout {said}; this gmlx_lab reads {layout!r} "
                                  "(save the cache again with this version)")
        self.items = list(state[:-1])
        if len(self.items) < fixed:
            raise SavedCacheError(f"{self.cls}: the saved state has {len(self.items)} items before its layout tag; "
                                  f"{layout} has at least {fixed}")

    def name_layer(self, layer: Any) -> None:
        """Name the layer in later messages, once its item is read."""
        self.where = f"layer {layer} ({self.cls})" if layer is not None else self.cls

    def fail(self, message: str) -> SavedCacheError:
        return SavedCacheError(f"{self.where}: {message}")

    def integer(self, value: Any, name: str, low: int = 0, high: int | None = None, none: bool = False) -> Any:
        """An int in [low, high] (None allowed where `none`)."""
        if value is None and none:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{name} is {value!r}; expected an int" + (" or None" if none else ""))
        if value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise self.fail(f"{name} is {value}; expected an int {span}")
        return value

    def present(self, value: Any, name: str) -> Any:
        """An item the file holds (mlx-lm's tree_unflatten leaves {} where a saved item is missing)."""
        if isinstance(value, dict):
            raise self.fail(f"{name} is missing from the file")
        return value

    def array(self, value: Any, name: str, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
        """An mx.array of exactly this shape and dtype."""
        value = self.present(value, name)
        if not isinstance(value, mx.array):
            raise self.fail(f"{name} is {describe(value)}; expected an array {shape} {dtype}")
        if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
            raise self.fail(f"{name} holds {tuple(value.shape)} {value.dtype}; expected {tuple(shape)} {dtype}")
        return value

    def common(self, items: dict[str, Any]) -> int:
        """The scalars every layout keeps (layer, offset, window size, dropped, sliding window and hold, K/V shape);
        names the layer and returns the offset."""
        self.name_layer(self.integer(self.present(items["layer"], "layer"), "layer", none=True))
        offset = self.integer(self.present(items["offset"], "offset"), "offset")
        self.integer(self.present(items["max_kv_size"], "max_kv_size"), "max_kv_size", 1, none=True)
        self.integer(self.present(items["dropped"], "dropped"), "dropped (tokens the window dropped)", high=offset)
        for name in ("sliding_window", "sliding_hold"):
            self.integer(self.present(items[name], name), name, 1, none=True)
        shape = [self.present(x, n) for x, n in zip(items["shape"], SHAPE_NAMES)]
        if any(x is not None for x in shape):
            for x, n in zip(shape, SHAPE_NAMES):
                self.integer(x, n, 1)
        return offset

    def held_state(self, cache: Any) -> None:
        """What a loaded cache holds, checked by the cache itself: its rolling window, then (unless the loader says
        not to) every region's finiteness."""
        try:
            cache.window_check(cache.max_kv_size)
        except ValueError as exc:
            raise self.fail(f"max_kv_size: {exc}") from None
        if checks_finite():
            try:
                cache.check_stored_finite()
            except ValueError as exc:
                raise self.fail(f"{str(exc).split(': ', 1)[-1]} (load with check_finite=False to inspect it)") from None

    def pair(self, k: Any, v: Any, name: str) -> bool:
        """True if a K/V pair is saved, False if both are None (the region is empty); a half pair is refused."""
        k, v = self.present(k, f"{name} K"), self.present(v, f"{name} V")
        if (k is None) != (v is None):
            raise self.fail(f"{name} has {'K' if v is None else 'V'} but not {'V' if v is None else 'K'}")
        return k is not None


def load_prompt_cache(path: str | Path, return_metadata: bool = False, check_finite: bool = True) -> Any:
    """mlx-lm's `load_prompt_cache`, with every error naming the file and the cache's place in it, and the
    finiteness scan of each cache's stored values unless `check_finite=False` (`check_finite()` runs it later)."""
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as exc:
        raise SavedCacheError(f"{path}: cannot be read as a prompt-cache file ({exc})") from None
    try:
        metadata, classes, scalars = tree_unflatten(list(meta.items()))
    except (ValueError, TypeError, KeyError):
        raise SavedCacheError(f"{path}: its metadata is not a prompt cache's (mlx-lm's save_prompt_cache writes "
                              "the user's metadata, the cache classes and the kinds of the scalars)") from None
    kinds = {"scalar": lambda a: a.item(), "string": lambda a: "".join(chr(i) for i in a.tolist()),
             "none": lambda a: None}
    for pos, kind in scalars[1:]:
        if pos not in arrays:
            raise SavedCacheError(f"{path}: cache {pos.split('.')[0]}'s state item {pos} (a {kind}) is missing")
        if kind not in kinds:
            raise SavedCacheError(f"{path}: item {pos} has scalar kind {kind!r}; accepted: {', '.join(kinds)}")
        arrays[pos] = kinds[kind](arrays[pos])
    states = tree_unflatten(list(arrays.items())) if arrays else []
    if len(states) != len(classes):
        raise SavedCacheError(f"{path}: {len(classes)} cache classes but {len(states)} saved states")
    caches = []
    token = _FINITE.set(check_finite)
    try:
        for i, (name, state) in enumerate(zip(classes, states)):
            cls = getattr(mlx_cache, name, None)
            if cls is None:
                raise SavedCacheError(f"{path}: cache {i} is a {name}, a class neither mlx-lm nor a registered "
                                      "gmlx_lab scheme defines (import the plug-in that registers it first)")
            try:
                caches.append(cls.from_state(state))
            except SavedCacheError as exc:
                raise SavedCacheError(f"{path}, cache {i}: {exc}") from None
    finally:
        _FINITE.reset(token)
    return (caches, metadata) if return_metadata else caches


def block_items(r: StateReader, fixed: int, geometry: tuple[str, ...]) -> list[Any]:
    """A block cache's saved items (cache/block.py's `state`: `fixed` items, then option name, value pairs) checked
    before anything is built from them: scalars in range, arrays in place."""
    items = r.items
    if (len(items) - fixed) % 2:
        raise r.fail(f"the options after the {fixed} fixed items are not name, value pairs")
    offset = r.common({"layer": items[8], "offset": items[6], "max_kv_size": items[16], "dropped": items[17],
                       "sliding_window": items[18], "sliding_hold": items[19], "shape": items[12:16]})
    r.integer(r.present(items[7], "newest"), "newest (tokens of the latest update)", high=offset)
    for name, value in zip(geometry, items[9:12]):
        r.integer(r.present(value, name), name, 1 if name == "block_tokens" else 0)
    for i, region in ((0, "sink"), (4, "recent")):
        if r.pair(items[i], items[i + 1], region):
            for kind, x in zip("KV", items[i:i + 2]):
                if not isinstance(x, mx.array) or x.ndim != 4:
                    raise r.fail(f"{region} {kind} is {describe(x)}; expected a 4-d array (batch, kv "
                                 "heads, tokens, head_dim)")
    if r.pair(items[2], items[3], "blocks"):
        for kind, parts in zip("KV", items[2:4]):
            if not isinstance(parts, (list, tuple)) or not parts:
                raise r.fail(f"blocks {kind} is {describe(parts)}; expected the parts of the encoded blocks")
            for i, x in enumerate(parts):
                if not isinstance(r.present(x, f"blocks {kind} part {i}"), mx.array) or x.ndim < 3:
                    raise r.fail(f"blocks {kind} part {i} is {describe(x)}; expected an array (batch, "
                                 "kv heads, blocks, ...)")
    names = items[fixed::2]
    if not all(isinstance(n, str) for n in names):
        raise r.fail(f"option names {names!r}; expected strings")
    return items


def block_loaded(cache: Any, r: StateReader, store_dtype: mx.Dtype) -> None:
    """The loaded arrays against the geometry: each array's shape and dtype, the regions adding up to the tokens
    held with nothing due left unencoded, and (unless the loader says not to) every value finite."""
    if cache.kv_shape is None:
        if cache.offset or cache.sink is not None or cache.body is not None or cache.recent_count:
            raise r.fail(f"holds tokens (offset {cache.offset}) but no K/V shape")
        r.held_state(cache)
        return
    b, h, dk, dv = cache.kv_shape
    try:
        cache.check_head_dims(dk, dv)
    except ValueError as exc:
        raise r.fail(f"its K/V shape {cache.kv_shape}: {exc}") from None
    sink = min(cache.offset, cache.sink_tokens)
    for kind, d, x in (("K", dk, None if cache.sink is None else cache.sink.k),
                       ("V", dv, None if cache.sink is None else cache.sink.v)):
        if sink or x is not None:
            r.array(x, f"sink {kind}", (b, h, sink, d), store_dtype)
    blocks = cache.n_blocks
    for kind, d, parts in (("k", dk, cache.body and cache.body.k), ("v", dv, cache.body and cache.body.v)):
        if parts is None:
            continue
        want = cache.trial_block(kind, d)
        if len(parts) != len(want):
            raise r.fail(f"blocks {kind.upper()} have {len(parts)} parts; {type(cache).__name__} encodes "
                         f"{len(want)}")
        for i, (x, w) in enumerate(zip(parts, want)):
            r.array(x, f"blocks {kind.upper()} part {i}", (b, h, blocks, *w.shape[3:]), w.dtype)
    recent = cache.held - sink - blocks * cache.block_tokens
    if recent < 0:
        raise r.fail(f"its sink ({sink}) and {blocks} blocks of {cache.block_tokens} hold more than the "
                     f"{cache.held} tokens that offset {cache.offset} less dropped {cache.dropped} leave")
    for kind, d, buf in (("K", dk, cache.recent.k), ("V", dv, cache.recent.v)):
        if recent or cache.recent_count:
            r.array(buf.data if cache.recent_count else None, f"recent {kind}", (b, h, recent, d), store_dtype)
    if cache.encode_on_arrival and cache.newest:
        raise r.fail(f"newest is {cache.newest}; {type(cache).__name__} encodes on arrival, so it is 0")
    if cache.due_blocks():
        raise r.fail(f"{cache.due_blocks()} complete blocks of its recent tokens are due to be encoded")
    r.held_state(cache)
