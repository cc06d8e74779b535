"""The kvarn format: records (variance-normalized 128x128 tiles of K or V, bit-packed) and a cache's regions.

This is the one home of kvarn's layout, read by the cache (`cache/kvarn/`), the kernels
(`kernels/`) and the figures: nothing here knows a cache class.

A record holds one KV head's 128-channel slice of 128 consecutive tokens, already
Hadamard-rotated. For K the tile's rows are channels, for V they are tokens. Two
scale vectors (rows and columns) are found by alternating normalization so that
no row or column dominates; each row of the normalized tile is then rounded
asymmetrically to `bits`-bit codes. Storage: packed codes (2048*bits bytes) and
three fp16 vectors of 128 (768 bytes); decoding is
`T[r, c] = (q[r, c] * scale_axis[r] + zp_axis[r]) * other_axis[c]`.

A kvarn cache layer holds, oldest first: the sink (the first 128 tokens, fp16), the body (sealed
records) and the recent tokens (fp16: the live group and the tail). `region_tokens` is its geometry.
Every encoding function works on a batch of tiles (..., 128, 128) at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx

from ..buffers import KV
from ..regions import block_regions

TILE = 128  # tokens per record, and channels per record slice
KVARN_BITS = (2, 3, 4, 5, 6, 8)  # the code widths of a record
KVARN_HEAD_DIMS = (128, 256, 512)  # gmlx's format: heads of whole 128-channel record slices
KVARN_EXT_HEAD_DIMS = (64, 96)  # the head-dim extension (option head_dim_ext=1): records of 128 tokens x the head
SINK_TOKENS = 128  # the first tokens of a layer, kept fp16 (attention sinks)
AXIS_DTYPE = mx.float16
STD_CLAMP = (1e-3, 1e3)
LOG_SCALE_CLIP = (-0.3, 10.0)
IMBALANCE_EPS = 1e-8


def head_dim_problem(head_dim: int, ext: int = 0) -> str | None:
    """Why kvarn cannot store heads of `head_dim`, or None if it can: the one home of the head-dim rule (the cache,
    the policy and the kernels ask it). `ext` (option head_dim_ext=1) also takes 64 and 96."""
    if head_dim in KVARN_HEAD_DIMS or (ext and head_dim in KVARN_EXT_HEAD_DIMS):
        return None
    hint = " (head_dim_ext=1 takes 64/96)" if head_dim in KVARN_EXT_HEAD_DIMS else ""
    return f"head_dim {head_dim}: kvarn needs {'/'.join(map(str, KVARN_HEAD_DIMS))}{hint}"


def record_bytes(bits: int, channels: int = TILE, kind: str = "k") -> int:
    """Bytes of one record: 128 tokens x `channels` codes of `bits` bits plus three fp16 axis vectors, two along
    the tile's rows (K: channels, V: tokens) and one along its columns. gmlx's records have 128 channels:
    2048 * bits + 768 bytes for K and V alike."""
    rows, cols = (channels, TILE) if kind == "k" else (TILE, channels)
    return TILE * channels * bits // 8 + (2 * rows + cols) * 2


def slice_width(head_dim: int) -> int:
    """Channels per record: 128 (gmlx's format: head dims 128, 256, 512 are whole slices), or the whole head
    for the narrower heads of the head-dim extension (64, 96)."""
    return min(head_dim, TILE)


def region_tokens(context: int, kv_tail_tokens: int, newest: int = 1) -> dict[str, int]:
    """Tokens in each region of a kvarn layer after `context` tokens, the last `newest` of them in one update.

    The sink takes the first 128 tokens. A later token is sealed into a record once its group of 128 is
    complete and had left the newest `kv_tail_tokens` before the latest update arrived (the latest update's
    tokens stay fp16 and decide nothing that is sealed, so trimming them gives back the cache that never saw
    them, and a prompt chunk attends to its own tokens exactly). Token by token (newest=1), that is one token
    after the group leaves the tail.
    "live" is the fp16 tokens between the body and the tail.
    """
    return block_regions(context, TILE, SINK_TOKENS, kv_tail_tokens, newest, tail_before_update=True)


def words_per_row(bits: int, codes: int = TILE) -> int:
    """uint32 words holding one row of `codes` codes (128 in gmlx's records): codes * bits / 32."""
    return codes * bits // 32


def pack_rows(codes: mx.array, bits: int) -> mx.array:
    """Pack codes (..., 128) of `bits` bits into (..., 4*bits) uint32 words.

    Code i occupies bits [i*bits, (i+1)*bits) of the row's bit stream, least
    significant bit first; stream bit j is bit j % 32 of word j // 32. Codes of
    3, 5 and 6 bits cross word boundaries; the kernels read the same layout.
    """
    codes = codes.astype(mx.uint32)
    bit_index = mx.arange(bits, dtype=mx.uint32)
    stream = (codes[..., None] >> bit_index) & 1  # (..., 128, bits)
    stream = stream.reshape(*codes.shape[:-1], words_per_row(bits, codes.shape[-1]), 32)
    return (stream << mx.arange(32, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)


def unpack_rows(words: mx.array, bits: int) -> mx.array:
    """Inverse of `pack_rows`: (..., 4*bits) uint32 words to (..., 128) codes (uint32).

    Code i is stream bits [i*bits, (i+1)*bits). When `bits` divides 32 each word holds 32/bits whole codes
    (shift and mask). Otherwise every `bits` bytes hold 8 codes, and code j of such a group lies in its bytes
    j*bits//8 and the next one: the stream read as little-endian bytes, which all of MLX's hosts are.
    """
    mask = (1 << bits) - 1
    n = words.shape[-1] * 32 // bits  # codes per row: 128 in gmlx's records
    if 32 % bits == 0:
        shifts = mx.arange(32 // bits, dtype=mx.uint32) * bits
        return ((words[..., None] >> shifts) & mask).reshape(*words.shape[:-1], n)
    groups = words.view(mx.uint8).reshape(*words.shape[:-1], n // 8, bits).astype(mx.uint32)
    codes = []
    for j in range(8):
        byte, shift = divmod(j * bits, 8)
        x = groups[..., byte]
        if shift + bits > 8:  # the code continues in the next byte
            x = x | (groups[..., byte + 1] << 8)
        codes.append((x >> shift) & mask)
    return mx.stack(codes, axis=-1).reshape(*words.shape[:-1], n)


def _stds(x: mx.array) -> tuple[mx.array, mx.array]:
    """Unbiased std of each column (over rows) and of each row (over columns), float32."""
    return mx.std(x, axis=-2, ddof=1), mx.std(x, axis=-1, ddof=1)


def imbalance(x: mx.array) -> mx.array:
    """max/min of the column stds plus max/min of the row stds: 2 for a perfectly balanced tile."""
    col, row = _stds(x)
    ratio = lambda s: s.max(axis=-1) / (s.min(axis=-1) + IMBALANCE_EPS)  # noqa: E731
    return ratio(col) + ratio(row)


def normalize(tiles: mx.array, iters: int = 16, history: list[mx.array] | None = None,
              ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Find row and column scales that balance the stds of tiles (..., 128, 128).

    Each round divides by the column stds, then by the row stds (in log space,
    clamped, clipped); the round with the lowest imbalance wins, ties going to
    the later round, and the unscaled tile is a candidate too. Returns s_row,
    s_col, and the imbalance before and after; `history`, if given, receives every
    round's imbalance (round 0 first) for the notebooks.
    """
    t = tiles.astype(mx.float32)
    log_row = mx.zeros(t.shape[:-1], mx.float32)
    log_col = mx.zeros(t.shape[:-2] + t.shape[-1:], mx.float32)
    scaled = lambda: t / (mx.exp(log_row)[..., :, None] * mx.exp(log_col)[..., None, :])  # noqa: E731
    start = imbalance(t)
    best, best_row, best_col = start, log_row, log_col
    if history is not None:
        history.append(start)
    for _ in range(iters):
        col_std, _ = _stds(scaled())
        log_col = mx.clip(log_col + mx.log(mx.clip(col_std, *STD_CLAMP)), *LOG_SCALE_CLIP)
        _, row_std = _stds(scaled())
        log_row = mx.clip(log_row + mx.log(mx.clip(row_std, *STD_CLAMP)), *LOG_SCALE_CLIP)
        score = imbalance(scaled())
        if history is not None:
            history.append(score)
        better = score <= best
        best = mx.where(better, score, best)
        best_row = mx.where(better[..., None], log_row, best_row)
        best_col = mx.where(better[..., None], log_col, best_col)
    return mx.exp(best_row), mx.exp(best_col), start, best


@dataclass
class Records:
    """A batch of encoded records; every field has the same leading batch shape."""

    codes: mx.array  # (..., 128 rows, 4*bits) uint32
    scale_axis: mx.array  # (..., 128) fp16, per row
    zp_axis: mx.array  # (..., 128) fp16, per row
    other_axis: mx.array  # (..., 128) fp16, per column
    bits: int
    kind: str  # "k": rows are channels; "v": rows are tokens
    imbalance_before: mx.array | None = None
    imbalance_after: mx.array | None = None

    @property
    def nbytes(self) -> int:
        """Stored bytes: packed codes plus the three fp16 axis vectors."""
        return sum(a.nbytes for a in self.arrays)

    @property
    def arrays(self) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The stored arrays: codes, scale_axis, zp_axis, other_axis."""
        return self.codes, self.scale_axis, self.zp_axis, self.other_axis

    @property
    def count(self) -> int:
        """Records along axis 2 of a cache body (B, H, R, S, ...)."""
        return self.codes.shape[2]

    def take(self, index: tuple) -> Records:
        """The records at `index` of every field (e.g. one head's record), without the imbalances."""
        return replace(self, codes=self.codes[index], scale_axis=self.scale_axis[index],
                       zp_axis=self.zp_axis[index], other_axis=self.other_axis[index],
                       imbalance_before=None, imbalance_after=None)


@dataclass
class KvarnParts:
    """A kvarn layer's arrays as the kernels read them: the format, not a cache class.

    sink: K, V (B, H, NS, D) fp16; body: K, V records with fields (B, H, R, S, ...), or None;
    recent: K, V (B, H, CAP, D) fp16 buffers whose first `recent_tokens` rows hold tokens, or None.
    The sink and recent tokens are in the model's space, the records in rotated space.
    """

    sink: KV  # of arrays
    body: KV | None  # of Records
    recent: KV | None  # of arrays
    recent_tokens: int

    @property
    def bits(self) -> KV:
        return KV(self.body.k.bits, self.body.v.bits) if self.body is not None else KV(0, 0)


def check_bits(bits: int) -> None:
    if bits not in KVARN_BITS:
        raise ValueError(f"kvarn bits={bits!r} is not supported; accepted: {', '.join(map(str, KVARN_BITS))}")


def check_kind(kind: str) -> None:
    if kind not in ("k", "v"):
        raise ValueError(f"record kind={kind!r} is not supported; accepted: 'k' or 'v'")


def encode_tiles(tiles: mx.array, bits: int, kind: str, iters: int = 16) -> Records:
    """Encode tiles (..., 128, 128), already in row/column orientation for `kind`."""
    check_bits(bits)
    check_kind(kind)
    s_row, s_col, before, after = normalize(tiles, iters)
    n = tiles.astype(mx.float32) / (s_row[..., :, None] * s_col[..., None, :])
    lo, hi = n.min(axis=-1), n.max(axis=-1)
    scale = mx.maximum((hi - lo) / (2**bits - 1), 1e-10)
    q = mx.floor((n - lo[..., None]) / scale[..., None] + 0.5)  # round half away from zero (q >= 0)
    q = mx.clip(q, 0, 2**bits - 1)
    return Records(
        codes=pack_rows(q, bits),
        scale_axis=(s_row * scale).astype(AXIS_DTYPE),
        zp_axis=(s_row * lo).astype(AXIS_DTYPE),
        other_axis=s_col.astype(AXIS_DTYPE),
        bits=bits,
        kind=kind,
        imbalance_before=before,
        imbalance_after=after,
    )


def decode_tiles(codes: mx.array, scale_axis: mx.array, zp_axis: mx.array, other_axis: mx.array,
                 bits: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """Decode tiles (..., 128, 128) in the record's row/column orientation."""
    q = unpack_rows(codes, bits).astype(dtype)
    rows = q * scale_axis[..., None].astype(dtype) + zp_axis[..., None].astype(dtype)
    return rows * other_axis[..., None, :].astype(dtype)


def records_attention(queries: mx.array, scale: float, k: Records, v: Records) -> tuple[mx.array, mx.array]:
    """Attention of rotated queries (B, Hq, L, D) over every token of K and V records (fields (B, Hkv, n, S, ...))
    from their codes, by two `mx.quantized_matmul` calls a record and slice: a record's codes are packed as
    mx.quantize packs them, each row one affine group (scale_axis, zp_axis), so a K record (channels x tokens)
    scores the queries as it is and a V record (tokens x channels) weighs the probabilities; the column factors
    (`other_axis`) scale the scores by token and the output by channel. Returns the output (B, Hq, L, D), in the
    records' space, and the scores' log-sum-exp (B, Hq, L), for `merge_partials`."""
    b, hq, length, d = queries.shape
    hkv, n, s, w = k.codes.shape[1], k.codes.shape[2], k.codes.shape[3], k.codes.shape[4]
    rows = hq // hkv * length
    # a kv head's query rows as one matrix, cut into the records' slices: (B, Hkv, 1, S, G L, w)
    q = (queries * scale).reshape(b, hkv, rows, s, w).transpose(0, 1, 3, 2, 4)[:, :, None]

    def affine(r: Records) -> tuple[mx.array, mx.array, mx.array]:
        return r.codes, r.scale_axis[..., None].astype(q.dtype), r.zp_axis[..., None].astype(q.dtype)

    scores = mx.quantized_matmul(q, *affine(k), transpose=False, group_size=TILE, bits=k.bits)
    scores = (scores * k.other_axis[..., None, :].astype(q.dtype)).sum(axis=3)  # (B, Hkv, n, G L, 128)
    scores = scores.transpose(0, 1, 3, 2, 4).reshape(b, hkv, rows, n * TILE)
    lse = mx.logsumexp(scores, axis=-1, keepdims=True)
    probs = mx.exp(scores - lse).reshape(b, hkv, rows, n, TILE).transpose(0, 1, 3, 2, 4)[:, :, :, None]
    out = mx.quantized_matmul(probs, *affine(v), transpose=False, group_size=w, bits=v.bits)
    out = (out * v.other_axis[..., None, :].astype(q.dtype)).sum(axis=2)  # (B, Hkv, S, G L, w)
    out = out.transpose(0, 1, 3, 2, 4).reshape(b, hq, length, d)
    return out, lse.reshape(b, hq, length)


def to_tiles(x: mx.array, kind: str) -> mx.array:
    """Tokens (B, H, n*128, D) to record tiles (B, H, n, D/128, rows, cols) oriented for `kind`."""
    b, h, t, d = x.shape
    w = slice_width(d)
    tiles = x.reshape(b, h, t // TILE, TILE, d // w, w).transpose(0, 1, 2, 4, 3, 5)
    return tiles.swapaxes(-1, -2) if kind == "k" else tiles


def from_tiles(tiles: mx.array, kind: str) -> mx.array:
    """Inverse of `to_tiles`: tiles (B, H, n, S, rows, cols) back to tokens (B, H, n*128, S*128)."""
    if kind == "k":
        tiles = tiles.swapaxes(-1, -2)
    b, h, n, s, _, w = tiles.shape
    return tiles.transpose(0, 1, 2, 4, 3, 5).reshape(b, h, n * TILE, s * w)


def encode_tokens(x: mx.array, bits: int, kind: str, iters: int = 16) -> Records:
    """Encode rotated tokens (B, H, n*128, D) as records with fields (B, H, n, D/128, ...)."""
    return encode_tiles(to_tiles(x, kind), bits, kind, iters)


def decode_tokens(records: Records, dtype: mx.Dtype = mx.float32) -> mx.array:
    """Records with fields (B, H, n, S, ...) back to rotated tokens (B, H, n*128, S*128)."""
    return from_tiles(decode_tiles(*records.arrays, records.bits, dtype), records.kind)


def encode_record(block: mx.array, bits: int, kind: str, iters: int = 16) -> Records:
    """Encode one (128 tokens, 128 channels) block, already rotated, as a K or V record."""
    check_bits(bits)
    check_kind(kind)
    if tuple(block.shape) != (TILE, TILE):
        raise ValueError(f"encode_record: block must be (128 tokens, 128 channels), got {tuple(block.shape)}")
    if not mx.all(mx.isfinite(block)).item():
        raise ValueError("encode_record: block holds non-finite values (inf or nan); K/V must be finite")
    tile = block.T if kind == "k" else block
    return encode_tiles(tile, bits, kind, iters)


def decode_record(record: Records) -> mx.array:
    """The (128 tokens, 128 channels) float32 reconstruction of one record."""
    tile = decode_tiles(record.codes, record.scale_axis, record.zp_axis, record.other_axis, record.bits)
    return tile.T if record.kind == "k" else tile
