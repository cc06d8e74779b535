"""Self-check of the fused kernels on first use: each runs once on a small case and must match its emulation.

A kernel that fails to compile on this GPU (a Metal or CUDA version we never ran), or computes wrong, would
otherwise break or, worse, quietly skew every quantized cache. So before the first fused call in a process,
`passed(name)` runs that kernel's check; on a compile error or a mismatch the caches take the pure-MLX
reference path instead, and say so loudly: a warning with the reason, a note in the policy's [kv] line and
the cache's `attention_route()`. Results are kept for the process. On the CPU no kernel runs (not applicable).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from ..cache.buffers import KV
from ..cache.kvarn.records import KvarnParts, decode_tokens, encode_tokens, unpack_rows
from . import config
from .affine import affine_attend, affine_partials
from .blocks import BlockCall, BlockLayout, Fp16Tokens, block_attend, value_tables
from .build import active_backend, forget_kernels, kernel_backend
from .kvarn import kvarn_attend, kvarn_partials, kvarn_tokens, seal_records, unpack_records
from .splits import SplitCounter, group_queries, merge_splits

TOLERANCE = 1e-2  # relative error against the float32 emulation (the tensor cores take float16 operands)


@dataclass(frozen=True)
class CheckResult:
    """One kernel's self-check: passed, why not, and how long it took (seconds, compile included)."""

    kernel: str
    passed: bool
    reason: str
    seconds: float


_results: dict[str, CheckResult] = {}
_epoch = 0  # results recorded or forgotten so far (`context`)


def _relative(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).flatten()) / mx.maximum(mx.linalg.norm(b.flatten()), 1e-30)).item()


def _kvarn_case() -> tuple[mx.array, KvarnParts]:
    """Queries (1, 4, 1, 128) and a small kvarn layer: 2 records, the sink and 130 recent tokens, 2 kv heads."""
    mx.random.seed(11)
    x = mx.random.normal((2, 1, 2, 128 + 2 * 128 + 130, 128)).astype(mx.float16)
    k, v = x[0], x[1]
    body = KV(*(encode_tokens(mx.hadamard_transform(t[:, :, 128:384]), 4, kind) for t, kind in ((k, "k"), (v, "v"))))
    parts = KvarnParts(KV(k[:, :, :128], v[:, :, :128]), body, KV(k[:, :, 384:], v[:, :, 384:]), 130)
    return mx.random.normal((1, 4, 1, 128)).astype(mx.float16), parts


def _check_kvarn_decode() -> float:
    """The decode attention as the caches run it (on CUDA one launch that merges its splits; else with
    split_merge), and the split partials with split_merge, each against the emulation."""
    q, parts = _kvarn_case()
    ref = kvarn_attend(q, 0.09, None, parts, emulate=True)
    qg = group_queries(q, 2)
    ko, kl, kn = kvarn_partials(qg, 0.09, parts, 1, False, per_warp=1)
    eo, el, _ = kvarn_partials(qg, 0.09, parts, 1, False, per_warp=1, emulate=True)
    out, _ = merge_splits(ko, kl, rotate=True, rotated_splits=kn)
    want, _ = merge_splits(eo, el, rotate=True, emulate=True, rotated_splits=kn)
    return max(_relative(kvarn_attend(q, 0.09, None, parts), ref), _relative(out, want))


def _check_affine_decode() -> float:
    """As for kvarn: the route the caches take (a rotated cache's, which also rotates back), and the split
    partials with split_merge, against the emulation."""
    mx.random.seed(12)
    k, v = (mx.random.normal((1, 2, 300, 128)) for _ in range(2))
    parts = [list(mx.quantize(t.astype(mx.float16), group_size=64, bits=4)) for t in (k, v)]
    q = mx.random.normal((1, 4, 1, 128)).astype(mx.float16)
    qg = group_queries(q, 2)
    out, _ = merge_splits(*affine_partials(qg, 0.09, parts[0], parts[1], 300, 4, 64, 1, False, per_split=1))
    ref, _ = merge_splits(*affine_partials(qg, 0.09, parts[0], parts[1], 300, 4, 64, 1, False, per_split=1,
                                           emulate=True), emulate=True)
    routed = affine_attend(q, 0.09, None, parts, 300, 4, 64, rotate=True)
    want = affine_attend(q, 0.09, None, parts, 300, 4, 64, rotate=True, emulate=True)
    return max(_relative(out, ref), _relative(routed, want), _check_block_layouts())


def _check_block_layouts() -> float:
    """The block caches' layouts as the caches run them (a kept call reading the blocks and the fp16 tokens) against
    the emulation, with two query tokens under the causal mask: KIVI's K (per channel over 32-token blocks, 3-bit
    codes crossing words) with 2-bit V; TurboQuant's codebook codes (random words: every bit pattern is a code)
    times fp16 norms, 3-bit K and 8-bit V, in a signed Hadamard space; and codes with byte scales looked up in
    groups of 16 (nvfp4's), Hadamard-rotated. Each with a 4-token sink and 40 recent tokens in a 64-token buffer."""
    mx.random.seed(14)
    k, v = (mx.random.normal((1, 2, 9, 32, 128)).astype(mx.float16) for _ in range(2))
    kivi = [list(mx.quantize(mx.contiguous(k.swapaxes(-1, -2)), group_size=32, bits=3)),
            list(mx.quantize(v, group_size=32, bits=2))]
    norms = mx.random.uniform(0.5, 2.0, (1, 2, 9, 32, 1)).astype(mx.float16)
    words = {b: mx.random.randint(0, 2**31, (1, 2, 9, 32, 128 * b // 32)).astype(mx.uint32) for b in (3, 4, 8)}
    turbo = [[words[3], norms, norms], [words[8], norms, norms]]
    scale_bytes = mx.random.randint(0, 256, (1, 2, 9, 32, 8)).astype(mx.uint8)
    floats = [[words[4], scale_bytes, scale_bytes]] * 2
    table = mx.random.normal((256,)) * 0.1
    signs = mx.where(mx.random.normal((2, 1, 128)) > 0, 1.0, -1.0)
    layouts = (BlockLayout(kivi, (3, 2), 32, kchan=True),
               BlockLayout(turbo, (3, 8), 128, tables=value_tables(table[:8], table), rotation="signed", signs=signs),
               BlockLayout(floats, (4, 4), 16, tables=value_tables(table[:16], table[16:32], mx.abs(table) + 0.5),
                           rotation="hadamard"))
    sink = KV(*(mx.random.normal((1, 2, 4, 128)).astype(mx.float16) for _ in range(2)))
    recent = KV(*(mx.random.normal((1, 2, 64, 128)).astype(mx.float16) for _ in range(2)))
    q = mx.random.normal((1, 4, 2, 128)).astype(mx.float16)
    fp16, errors = Fp16Tokens(sink, recent, 40), []
    for layout in layouts:
        got = BlockCall(q.shape, 0.09, layout, 9, True, fp16)(q, 9, 40, SplitCounter())
        errors.append(_relative(got, block_attend(q, 0.09, layout, 9, fp16, True)))
    return max(errors)


def _check_kvarn_seal() -> float:
    mx.random.seed(13)
    x = mx.hadamard_transform(mx.random.normal((1, 2, 256, 128))).astype(mx.float16)
    got, want = seal_records(x, 4, "v"), encode_tokens(x, 4, "v")
    steps = mx.abs(unpack_rows(got.codes, 4).astype(mx.int32) - unpack_rows(want.codes, 4).astype(mx.int32))
    if steps.max().item() > 1 or mx.mean(steps > 0).item() > 2e-3:  # summation order may flip a rounding
        return float("inf")
    return _relative(decode_tokens(got), decode_tokens(want))


def _check_kvarn_unpack() -> float:
    """Rotated tokens, and the whole layer's K in the model's space (sink, body rotated back, recent tokens)."""
    _, parts = _kvarn_case()
    records, sink, recent = parts.body.k, parts.sink.k, parts.recent.k
    rotated = _relative(unpack_records(records, mx.float32), decode_tokens(records))
    whole = mx.concatenate([sink, mx.hadamard_transform(decode_tokens(records)).astype(mx.float16), recent], axis=2)
    return max(rotated, _relative(kvarn_tokens(sink, records, recent, parts.recent_tokens, mx.float32), whole))


CHECKS: dict[str, Callable[[], float]] = {
    "kvarn_decode": _check_kvarn_decode,  # with split_merge, which joins its splits
    "affine_decode": _check_affine_decode,
    "kvarn_seal": _check_kvarn_seal,
    "kvarn_unpack": _check_kvarn_unpack,
}


def run(name: str) -> CheckResult:
    """Run one kernel's check now (compiling it) and keep the result for the process."""
    if name not in CHECKS:
        raise ValueError(f"no self-check for kernel {name!r}; accepted: {', '.join(CHECKS)}")
    t0 = time.perf_counter()
    try:
        err = CHECKS[name]()
        passed, reason = err < TOLERANCE, f"relative error {err:.2e} against its emulation (limit {TOLERANCE})"
    except Exception as exc:  # noqa: BLE001  (a compile or launch error is what the check is for)
        passed, reason = False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    result = CheckResult(name, passed, reason, round(time.perf_counter() - t0, 3))
    _record(name, result)
    if not passed:
        warnings.warn(f"gmlx_lab kernel {name} failed its self-check on this GPU ({reason}); the caches use the "
                      "pure-MLX reference path for it (slower, correct). `gmlx-lab doctor` shows every check.",
                      RuntimeWarning, stacklevel=2)
    return result


def passed(name: str) -> bool:
    """Whether kernel `name` may be used on this GPU: its self-check ran (now, if not yet in this process) and
    passed. True on the CPU, where kernels run only on CPU threads in the tests (tests/test_kernels.py)."""
    if active_backend() == "cpu":
        return True
    result = _results.get(name) or run(name)
    return result.passed


def _record(name: str, result: CheckResult) -> None:
    global _epoch
    _results[name] = result
    _epoch += 1


def context() -> tuple[str, config.KernelConfig, int]:
    """What decides whether and how a fused kernel runs, as of now: the source the kernels run (the GPU's, or CPU
    threads'), the settings in force and the self-checks recorded so far. A call prepared in one context may be
    made again while it stays the same (KvarnCache's decode steps)."""
    return kernel_backend(), config.current(), _epoch


def failure(name: str) -> str | None:
    """Why kernel `name` is not used, if its self-check ran and failed (None otherwise)."""
    result = _results.get(name)
    return None if result is None or result.passed else result.reason


def reset() -> None:
    """Forget the results and the compiled kernels, so the next use compiles and checks again (tests; after
    changing a kernel's source in a session)."""
    global _epoch
    _results.clear()
    _epoch += 1
    forget_kernels()


def results() -> dict[str, CheckResult]:
    """The self-checks run so far in this process, by kernel (none run here)."""
    return dict(_results)


def report() -> list[CheckResult] | None:
    """Every kernel's self-check (running those not yet run), or None on the CPU, where no kernel runs."""
    if active_backend() == "cpu":
        return None
    return [_results.get(name) or run(name) for name in CHECKS]
