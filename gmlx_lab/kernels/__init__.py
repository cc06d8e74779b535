"""Fused GPU kernels for the quantized caches: one body per kernel, a prelude per backend (CUDA, Metal).

- `kvarn_decode`: decode attention straight from kvarn records on the tensor cores (split-K, online softmax);
- `affine_decode`: the same over mx.quantize codes (2..8 bits, groups 32/64/128), K per token or, for KIVI,
  per channel over blocks of 32 tokens; and over TurboQuant's codebook codes and norms (`blocks.py`);
- `split_merge`: merges the splits by log-sum-exp and rotates the records' share of the output back (on CUDA the
  split kernels can do that themselves, in their last threadgroup per kv head: the setting `merge_in_kernel`);
- `kvarn_seal`: variance normalization, rounding and packing of records;
- `kvarn_unpack`: records back to tokens; with the sink and recent tokens around them and rotated back, a
  layer's whole K or V in one pass (prefill attention, and K/V for models that read them).
Kernels take arrays and kvarn's record layout (`gmlx_lab/cache/kvarn/records.py`); they know no cache class.
On the CPU the caches use their pure-MLX reference attention; tests run the kernels' CUDA and Metal sources
on CPU threads there (`threads.py`, one fiber per GPU lane). The modules' tiers: `sources` (the texts) <-
`threads` (CPU lanes), `precompiled` (CUDA binaries kept on disk) <- `build` (backend, launch, compiled graphs;
reads `config`, the settings) <- `splits` (what the split-K decode kernels share) <- `kvarn`, `affine`, `blocks` (each
scheme's launch code) <- `selfcheck`.
"""

from . import precompiled, selfcheck  # noqa: E402  (after the modules it checks)
from .affine import AffineCall, affine_attend, affine_supported
from .blocks import BlockCall, BlockLayout, Fp16Tokens, block_attend, value_tables
from .build import active_backend
from .config import KernelConfig, configured, set_config
from .kvarn import KvarnCall, kvarn_attend, kvarn_supported, kvarn_tokens, seal_records, unpack_records
from .sources import assemble
from .splits import MAX_QUERY_TOKENS, SplitCounter, merge_splits

KERNELS = ("kvarn_decode", "affine_decode", "split_merge", "kvarn_seal", "kvarn_unpack")

__all__ = ["KERNELS", "AffineCall", "BlockCall", "BlockLayout", "Fp16Tokens", "KernelConfig", "KvarnCall",
           "MAX_QUERY_TOKENS", "SplitCounter", "active_backend", "assemble", "affine_attend", "affine_supported",
           "block_attend", "configured", "kvarn_attend", "kvarn_supported", "kvarn_tokens", "merge_splits",
           "precompiled", "seal_records", "selfcheck", "set_config", "unpack_records", "value_tables"]
