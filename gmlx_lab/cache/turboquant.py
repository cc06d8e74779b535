"""TurboQuant (Zandieh, Daliri, Hadian, Mirrokni; arXiv 2504.19874): a random rotation, then one scalar
codebook per coordinate, optimal for the rotated coordinates' distribution; the vector's norm kept beside.

A random rotation makes every coordinate of a unit vector follow one concentrated distribution (close to a
Gaussian of variance 1/d for head dims like 64-256), so one fixed Lloyd-Max codebook, computed once from that
distribution with no calibration data (`gaussian_codebook`), quantizes every coordinate of every vector. The
rotation here is a seeded randomized Hadamard transform (random sign flips per head, then the normalized
Hadamard transform): orthogonal and fast, not the paper's dense random rotation.

With `qjl=1` K spends one of its bits on the paper's inner-product variant: the codebook at k_bits - 1 bits,
then the sign of a seeded Gaussian projection S (d x d) of the residual r, and |r|. This cache hands
attention a dequantized K, k_mse + |r| sqrt(pi/2) / d * S^T sign(S r), so q . k is the paper's unbiased
estimate of the true score (tests/test_field_schemes.py checks the mean over seeds).

Codes are packed to their width into uint32 words (`pack_bits`), norms fp16: d * bits / 8 + 2 bytes per
vector, and d / 8 + 2 more for K's QJL signs and residual norm.

On a GPU a decode step attends from the codes (kernels/blocks.py: affine_decode reading each code's codebook
value times the token's norm): the queries are rotated once into the blocks' space and the blocks' share of the
output rotated back, then merged with the fp16 tokens' attention. With `qjl=1` it takes the reference path. On the CPU
a decode step attends in the rotated space too (the blocks decoded there, a slice at a time, none turned back), the
codes read several at a time by table (`lookup_codes`).

vLLM's presets in this lab's spec grammar: turboquant_k8v4 -> `turboquant:k8v4`, turboquant_4bit_nc ->
`turboquant4`, turboquant_k3v4_nc (3.5 bits a value) -> `turboquant:k3v4`, turboquant_3bit_nc -> `turboquant3`.
What it rotates, scales and keeps fp16, and its bytes per token: docs/field.md.
"""

from __future__ import annotations

import math
from functools import cache, lru_cache
from typing import Any

import mlx.core as mx
import numpy as np

from ..kernels import BlockLayout, value_tables
from ..registry import Option, register_scheme
from .block import BlockCache, BlockScheme
from .buffers import STORE_DTYPE
from .kernel_route import BlockKernelRoute
from .options import split_widths, width_options, with_sink

TURBOQUANT_BITS = (2, 3, 4, 8)


@cache
def gaussian_codebook(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd-Max quantizer of N(0, 1) with 2**bits levels: (centroids, the thresholds between them), float64.

    The Lloyd-Max conditions: each threshold is the midpoint of its two centroids, and each centroid the mean of
    the Gaussian between its thresholds a < b, T(c) = (pdf(a) - pdf(b)) / (Q(a) - Q(b)), Q the upper tail. The
    quantizer is symmetric, so only the positive half is solved (thresholds 0 < ... < inf). Lloyd's iteration
    c <- T(c) crawls at 128 levels, so this solves c = T(c) by Newton's method (T's Jacobian is tridiagonal),
    from the high-resolution optimum (Panter and Dite: cells dense as pdf^(1/3), the quantiles of N(0, 3)),
    until |c - T(c)| < 1e-12: deterministic, a few steps, once per width."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"gaussian_codebook: bits={bits!r}; accepted: an int from 1 to 8")
    half = 2 ** (bits - 1)
    c = math.sqrt(3) * np.array([_upper_inverse((half - i - 0.5) / (2 * half)) for i in range(half)])
    for _ in range(100):
        t = np.concatenate([[0.0], (c[1:] + c[:-1]) / 2, [np.inf]])
        a, b = t[:-1], t[1:]
        pa, pb = _pdf(a), _pdf(b)
        mass = _upper(a) - _upper(b)
        mean = (pa - pb) / mass
        f = c - mean
        if np.max(np.abs(f)) < 1e-12:
            break
        da = pa * (mean - a) / mass  # dT_i / d a_i, with a_i = (c_{i-1} + c_i) / 2 for i > 0
        db = pb * (np.where(np.isinf(b), 0.0, b) - mean) / mass  # dT_i / d b_i (0 at b = inf: pdf(inf) = 0)
        jac = np.eye(half)
        idx = np.arange(half)
        inner = idx > 0
        jac[idx[inner], idx[inner] - 1] -= da[inner] / 2
        jac[idx[inner], idx[inner]] -= da[inner] / 2
        outer = idx < half - 1
        jac[idx[outer], idx[outer]] -= db[outer] / 2
        jac[idx[outer], idx[outer] + 1] -= db[outer] / 2
        c = c - np.linalg.solve(jac, f)
    else:
        raise RuntimeError(f"gaussian_codebook({bits}): Newton's method did not converge")
    c = np.concatenate([-c[::-1], c])
    return c, (c[1:] + c[:-1]) / 2


def _pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _upper(x: np.ndarray) -> np.ndarray:
    """The Gaussian upper tail Q(x) = P(X > x), accurate far out."""
    return np.array([0.5 * math.erfc(v / math.sqrt(2)) for v in x])


def _upper_inverse(p: float) -> float:
    """x with Q(x) = p (Q the Gaussian upper tail), by bisection: a starting point for the codebook."""
    lo, hi = -10.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * math.erfc(mid / math.sqrt(2)) > p else (lo, mid)
    return (lo + hi) / 2


def pack_bits(codes: mx.array, bits: int) -> mx.array:
    """Codes (..., n), each < 2**bits, as a bit stream in uint32 words (..., ceil(n * bits / 32))."""
    n = codes.shape[-1]
    if 32 % bits == 0 and n * bits % 32 == 0:  # whole codes in a word, lowest bits first, as `unpack_bits` reads them
        per_word = 32 // bits
        shifted = codes.astype(mx.uint32).reshape(*codes.shape[:-1], n // per_word, per_word) << mx.arange(
            0, 32, bits, dtype=mx.uint32)
        return mx.sum(shifted, axis=-1).astype(mx.uint32)  # the codes' bits do not overlap: the sum is their OR
    stream = (mx.expand_dims(codes.astype(mx.uint32), -1) >> mx.arange(bits, dtype=mx.uint32)) & 1
    stream = stream.reshape(*codes.shape[:-1], n * bits)
    words = -(-n * bits // 32)
    if words * 32 > n * bits:
        stream = mx.concatenate([stream, mx.zeros((*codes.shape[:-1], words * 32 - n * bits), mx.uint32)], -1)
    stream = stream.reshape(*codes.shape[:-1], words, 32)
    return mx.sum(stream << mx.arange(32, dtype=mx.uint32), axis=-1).astype(mx.uint32)


def unpack_bits(words: mx.array, bits: int, n: int) -> mx.array:
    """The n codes of width `bits` that `pack_bits` stored in `words`, as uint32 (..., n)."""
    if 32 % bits == 0:  # whole codes in a word, lowest bits first: one shift and mask per code
        shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
        codes = (mx.expand_dims(words, -1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(*words.shape[:-1], -1)[..., :n]
    stream = (mx.expand_dims(words, -1) >> mx.arange(32, dtype=mx.uint32)) & 1
    stream = stream.reshape(*words.shape[:-1], -1)[..., : n * bits].reshape(*words.shape[:-1], n, bits)
    return mx.sum(stream << mx.arange(bits, dtype=mx.uint32), axis=-1).astype(mx.uint32)


@lru_cache(maxsize=64)
def head_signs(seed: int, heads: int, dim: int) -> mx.array:
    """Random signs (heads, 1, dim), one row per head: row h depends only on (seed, h)."""
    rows = [np.random.default_rng([seed, h]).integers(0, 2, dim) * 2 - 1 for h in range(heads)]
    return mx.array(np.stack(rows)[:, None, :].astype(np.float32))


@lru_cache(maxsize=64)
def qjl_matrix(seed: int, dim: int) -> mx.array:
    """The QJL projection S (dim x dim), i.i.d. N(0, 1) from the seed, rounded to multiples of 2**-10: then
    S^T sign(S r) sums exact float32 values, the same in any order (a batch row decodes as it does alone),
    and the rounding moves E[s sign(s . r)] by far less than float32 noise."""
    s = np.random.default_rng([seed, 1 << 20]).standard_normal((dim, dim))
    return mx.array((np.round(s * 1024) / 1024).astype(np.float32))


@lru_cache(maxsize=64)
def codebook(bits: int, d: int) -> mx.array:
    """The codebook of `bits` for head dim d: the Lloyd-Max centroids of N(0, 1) over sqrt(d), float32."""
    return mx.array(gaussian_codebook(bits)[0].astype(np.float32)) / math.sqrt(d)


@lru_cache(maxsize=64)
def window_table(bits: int, d: int) -> mx.array:
    """The codebook values of the 16 // bits codes a field of 16 // bits * bits bits holds, lowest first, for every
    such field: (2**(16 // bits * bits), 16 // bits) float32."""
    per = 16 // bits
    values, field = np.array(codebook(bits, d)), np.arange(1 << (per * bits))
    return mx.array(np.stack([values[(field >> (i * bits)) & ((1 << bits) - 1)] for i in range(per)], axis=-1))


def lookup_codes(words: mx.array, bits: int, d: int) -> mx.array:
    """The codebook values (..., d) of the d codes `pack_bits` stored in `words`: the codes are read as fields of
    16 // bits codes, one table lookup a field (`window_table`), a few times faster than a lookup a code."""
    per = 16 // bits
    if 16 % bits == 0:  # the fields are the words' uint16 halves
        fields = words.view(mx.uint16)
    else:  # field j starts at bit j * per * bits: the two words around it, shifted
        start = np.arange(-(-d // per)) * per * bits
        padded = mx.concatenate([words, mx.zeros((*words.shape[:-1], 1), mx.uint32)], axis=-1).astype(mx.uint64)
        pairs = mx.take(padded, mx.array(start // 32), axis=-1) | (mx.take(padded, mx.array(start // 32 + 1),
                                                                           axis=-1) << 32)
        fields = (pairs >> mx.array(start % 32, mx.uint64)) & ((1 << (per * bits)) - 1)
    x = mx.take(window_table(bits, d), fields.astype(mx.uint32), axis=0)
    return x.reshape(*words.shape[:-1], -1)[..., :d]


@lru_cache(maxsize=64)
def codebook_tables(k_bits: int, v_bits: int, d: int) -> mx.array:
    """affine_decode's tables for K's and V's codebooks (QJL off: K's codebook has all of K's bits)."""
    return value_tables(codebook(k_bits, d), codebook(v_bits, d))


class TurboQuantCache(BlockKernelRoute, BlockCache):
    """Randomized Hadamard rotation per head, Lloyd-Max codes per coordinate, fp16 norms (QJL for K optional)."""

    scheme = "turboquant"
    block_tokens = 32
    body_step = 8  # the blocks' buffers grow 256 tokens at a time, as mlx-lm's caches do: a step writes in place
    OPTIONS = (
        *width_options(4, TURBOQUANT_BITS),
        Option("qjl", 0, "1: K spends one bit on the QJL sign sketch of its residual (unbiased q.k)", (0, 1)),
        Option("kv_tail_tokens", 0, "newest tokens kept fp16"),
        Option("sink_tokens", 0, "first tokens kept fp16"),
        Option("seed", 0, "seed of the rotation's signs and of the QJL projection"),
    )
    complete = staticmethod(split_widths)  # K and V widths apart, each `bits` unless given

    def __init__(self, layer: int | None = None, **options: Any):
        super().__init__(layer, **options)
        self.encoded_dims: dict[str, int] = {}

    def rotate(self, x: mx.array) -> mx.array:
        return mx.hadamard_transform(x * head_signs(self.seed, x.shape[1], x.shape[-1]))

    def unrotate(self, x: mx.array) -> mx.array:
        return mx.hadamard_transform(x) * head_signs(self.seed, x.shape[1], x.shape[-1])

    def rotated_step(self) -> bool:
        """A CPU decode step attends in the rotated space: the blocks are always rotated."""
        return True

    def scale_group(self, kind: str) -> tuple[int, int]:
        """A token's whole rotated row shares its norm (the codebook is fixed), in K and V."""
        return 1, 0

    @classmethod
    def decode_path(cls, options: dict[str, Any] | None = None) -> str:
        """With QJL the reference path: the fused kernel does not read the sign sketch."""
        if options and options.get("qjl"):
            return "reference decode path with QJL (dequantize, then SDPA; the fused kernel reads no sign sketch)"
        return super().decode_path(options)

    def kernel_layout(self) -> BlockLayout | None:
        """The blocks as affine_decode reads them: codes that index the codebooks, each token's norm its scale, in
        the signed-Hadamard space; None with QJL, whose residual term the kernel does not read."""
        if self.qjl:
            return None
        body = [[codes.data, norms.data, norms.data] for codes, norms in self.body_buffers]  # no offsets to read
        hkv, d = body[0][0].shape[1], self._shape[2]
        return BlockLayout(body, (self.codebook_bits("k"), self.v_bits), d, tables=codebook_tables(self.k_bits,
                           self.v_bits, d), rotation="signed", signs=head_signs(self.seed, hkv, d))

    def codebook_bits(self, kind: str) -> int:
        """The codebook's width for K or V: the width, less the QJL bit for K with qjl."""
        return self.k_bits - bool(self.qjl) if kind == "k" else self.v_bits

    def encode(self, x: mx.array, kind: str) -> tuple[mx.array, ...]:
        d, bits = x.shape[-1], self.codebook_bits(kind)
        self.encoded_dims[kind] = d
        centroids, thresholds = (mx.array(a.astype(np.float32)) / math.sqrt(d) for a in gaussian_codebook(bits))
        norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
        u = x / mx.maximum(norm, 1e-30)
        # binary search over the sorted thresholds, one bit of the code per step, in bytes (codes are <= 8 bits):
        # every step's arrays are held until the whole update is computed, so they are kept small
        idx = mx.zeros(u.shape, mx.uint8)
        for level in reversed(range(bits)):
            above = u > mx.take(thresholds, idx + ((1 << level) - 1))
            idx = idx + (above.astype(mx.uint8) << level)
        norm16 = norm.astype(STORE_DTYPE)
        parts = (pack_bits(idx, bits), norm16)
        if kind == "k" and self.qjl:
            r = x - mx.take(centroids, idx) * norm16.astype(mx.float32)
            signs = (r @ qjl_matrix(self.seed, d).T) >= 0
            gamma = mx.sqrt(mx.sum(r * r, axis=-1, keepdims=True)).astype(STORE_DTYPE)
            parts += (pack_bits(signs, 1), gamma)
        return parts

    def decode(self, parts: tuple[mx.array, ...], kind: str) -> mx.array:
        d, bits = self.head_dim(parts[0], kind), self.codebook_bits(kind)
        x = lookup_codes(parts[0], bits, d) * parts[1].astype(mx.float32)
        if kind == "k" and self.qjl:
            signs = unpack_bits(parts[2], 1, d).astype(mx.float32) * 2 - 1
            x = x + parts[3].astype(mx.float32) * (math.sqrt(math.pi / 2) / d) * (signs @ qjl_matrix(self.seed, d))
        return x

    def head_dim(self, codes: mx.array, kind: str) -> int:
        """The head dim of packed codes: from the K/V shape the cache saw, else from the last block encoded (the
        trial block of `check_head_dims`, a `roundtrip`)."""
        if self._shape is not None:
            return self._shape[2] if kind == "k" else self._shape[3]
        return self.encoded_dims[kind]


class TurboQuantScheme(BlockScheme):
    """K and V widths apart, as vLLM's presets (`turboquant:k3v4` is 3.5 bits a value); the options are the
    class's (TurboQuantCache.OPTIONS)."""

    def label(self, values: dict[str, Any]) -> str:
        """`turboquant4`, `turboquant k3v4 qjl tail=128 sink=4` (the tail only when there is one)."""
        label = self.name + (f"{values['k_bits']}" if values["k_bits"] == values["v_bits"]
                             else f" k{values['k_bits']}v{values['v_bits']}")
        label += " qjl" if values["qjl"] else ""
        label += f" tail={values['kv_tail_tokens']}" if values["kv_tail_tokens"] else ""
        return with_sink(label, values)


SCHEME = register_scheme(TurboQuantScheme(
    "turboquant", "TurboQuant: randomized Hadamard rotation, Lloyd-Max codes per coordinate, fp16 norms, "
    "optional QJL residual for K", cache_class=TurboQuantCache, color="#d62728",
    examples=({"k_bits": 3, "v_bits": 4}, {"bits": 4, "qjl": 1, "sink_tokens": 4}, {"bits": 2, "kv_tail_tokens": 1})))
