"""KIVI (Liu et al., ICML 2024, arXiv 2402.02750): K quantized per channel, V per token, the newest tokens fp16.

Outlier channels make K hard to quantize token by token: one large channel stretches every group it sits in.
KIVI gives each K channel its own scale and offset over a block of tokens instead (the channel's values across
the block's 32 tokens share them), and V, whose errors average out over the attention weights, its groups of
32 channels per token. Codes are mlx's affine codes (`mx.quantize`), packed into uint32 words; scales and
offsets fp16. The block base keeps the newest `kv_tail_tokens` tokens (default 128, as HF transformers'
`residual_length`) and the block being filled in fp16, and derives the byte formula, the policy rule and the
audit from the class; the registry entry names the label. On a GPU a decode step attends from the codes
(kernels/blocks.py: affine_decode in KIVI's K layout, the fp16 tokens beside it), with no decoded copy; on the CPU
two `mx.quantized_matmul` calls read the same codes (a K block's channels are the rows of a matrix over its
tokens). Notebook 09 builds its own `my_kivi` to teach the block base. What it rotates, scales
and keeps fp16, and its bytes per token: docs/field.md.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..kernels import BlockLayout
from ..registry import Option, register_scheme
from .block import BlockCache, BlockScheme
from .buffers import STORE_DTYPE
from .kernel_route import BlockKernelRoute, MatmulCodes
from .options import split_widths, width_options, with_sink

V_GROUP = 32  # channels of a V token sharing one scale and offset (KIVI's group size)
KIVI_BITS = (2, 3, 4, 5, 6, 8)  # the widths mx.quantize's affine mode packs


class KiviCache(BlockKernelRoute, BlockCache):
    """K per channel over blocks of 32 tokens, V per token in groups of 32 channels, both affine codes."""

    scheme = "kivi"
    block_tokens = 32  # the tokens a K channel's scale and offset span (KIVI's group size)
    body_step = 8  # the blocks' buffers grow 256 tokens at a time, as mlx-lm's caches do: a step writes in place
    OPTIONS = (
        *width_options(2, KIVI_BITS),
        Option("kv_tail_tokens", 128, "newest tokens kept fp16 (HF's residual_length)"),
        Option("sink_tokens", 0, "first tokens kept fp16"),
    )
    complete = staticmethod(split_widths)  # K and V widths apart (`kivi:k2v4`), each `bits` unless given

    def encode(self, x: mx.array, kind: str) -> tuple[mx.array, mx.array, mx.array]:
        """K: each channel across the block's tokens (one group); V: each token in groups of 32 channels."""
        if kind == "k":
            # row-contiguous first: a transposed view handed to mx.quantize is suspected of the wrong H200 results
            # (docs/results.md); on the CPU both give the same codes
            channels = mx.contiguous(x.swapaxes(-1, -2).astype(STORE_DTYPE))
            return mx.quantize(channels, group_size=self.block_tokens, bits=self.k_bits)
        return mx.quantize(x.astype(STORE_DTYPE), group_size=V_GROUP, bits=self.v_bits)

    def decode(self, parts: tuple[mx.array, mx.array, mx.array], kind: str) -> mx.array:
        codes, scales, biases = parts
        # code * scale + offset in float32 (MLX dequantizes in the scales' dtype, rounding each value to float16)
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        if kind == "k":
            x = mx.dequantize(codes, scales, biases, group_size=self.block_tokens, bits=self.k_bits)
            return x.swapaxes(-1, -2)
        return mx.dequantize(codes, scales, biases, group_size=V_GROUP, bits=self.v_bits)

    def scale_group(self, kind: str) -> tuple[int, int]:
        """K: one channel across a block's 32 tokens; V: one token's 32 channels (each with an offset too)."""
        return (self.block_tokens, 1) if kind == "k" else (1, V_GROUP)

    def matmul_codes(self) -> MatmulCodes:
        """K's blocks (channels as rows, quantized along the block's tokens) and V's rows for `mx.quantized_matmul`."""
        return MatmulCodes(({"group_size": self.block_tokens, "bits": self.k_bits},
                            {"group_size": V_GROUP, "bits": self.v_bits}), k_channels=True)

    def kernel_layout(self) -> BlockLayout:
        """The blocks as affine_decode reads them: K per channel over each block, V per token in groups of 32."""
        return BlockLayout([[b.data for b in bufs] for bufs in self.body_buffers], (self.k_bits, self.v_bits), V_GROUP,
                           kchan=True)


class KiviScheme(BlockScheme):
    """K and V widths apart (`kivi:k2v4`), like kvarn's; the options are the class's (KiviCache.OPTIONS)."""

    def label(self, values: dict[str, Any]) -> str:
        """`kivi2 tail=128`, `kivi k2v4 tail=128 sink=4`."""
        return with_sink(super().label(values), values)


SCHEME = register_scheme(KiviScheme(
    "kivi", "KIVI: K per channel over blocks of 32 tokens, V per token in groups of 32 channels, fp16 recent window",
    cache_class=KiviCache, color="#8c564b",
    examples=({"k_bits": 4, "v_bits": 3, "kv_tail_tokens": 64}, {"bits": 2, "sink_tokens": 4, "kv_tail_tokens": 0})))
