"""Microscaling floats for K/V: mxfp4, nvfp4 and mxfp8 codes through `mx.quantize(..., mode=...)`.

Each token's row is cut into groups; a group shares one 8-bit scale and each value is a small float:
  mxfp4  4-bit E2M1 values, groups of 32 sharing a power-of-two (E8M0) scale (OCP Microscaling spec v1.0);
  nvfp4  4-bit E2M1 values, groups of 16 sharing an FP8 E4M3 scale (NVIDIA's NVFP4; MLX 0.32.4's mx.quantize
         returns no per-tensor scale by default, so none is stored);
  mxfp8  8-bit E4M3 values, groups of 32 sharing an E8M0 scale.
The format is (bits, group_size): 4 and 32, 4 and 16, 8 and 32 (the only ones MLX accepts). With
`rotation=1` each head is first turned by the normalized Hadamard transform, as affine_rot does. Specs may name
the format ("mxfp4", "nvfp4_rot", "mxfp8") or spell it out ("float4:g=16,rot=1"). The block base derives the byte
formula, the policy rule and the audit. On a GPU a decode step attends from the codes (kernels/blocks.py:
affine_decode looking each code and each scale byte up in the format's tables, `format_tables`), merged with the
fp16 tokens' attention; on the CPU the 4-bit formats' codes go to `mx.quantized_matmul`, and mxfp8_rot attends in
the rotated space. What it rotates, scales
and keeps fp16, and its bytes per token: docs/field.md.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import mlx.core as mx

from ..kernels import BlockLayout, value_tables
from ..registry import Option, register_scheme
from .block import BlockCache, BlockScheme
from .kernel_route import BlockKernelRoute, MatmulCodes
from .options import with_sink

FORMATS = {(4, 32): "mxfp4", (4, 16): "nvfp4", (8, 32): "mxfp8"}  # (bits, group_size) -> mx.quantize mode


def float_format(bits: int, group_size: int) -> str:
    """The mx.quantize mode of these widths, or a ValueError naming the formats accepted."""
    if (bits, group_size) not in FORMATS:
        accepted = ", ".join(f"{name} (bits={b}, group_size={g})" for (b, g), name in FORMATS.items())
        raise ValueError(f"float: bits={bits}, group_size={group_size} is no format; accepted: {accepted}")
    return FORMATS[(bits, group_size)]


@lru_cache(maxsize=8)
def format_tables(bits: int, group_size: int) -> mx.array:
    """affine_decode's tables for a format: what each code and each scale byte stands for, read off mx.dequantize
    itself (value[code] * scale[byte] is what it gives): every code under the scale byte of a group of ones, and the
    code of one under every scale byte, divided by one's own value."""
    mode = float_format(bits, group_size)
    # a group of ones: the code and the scale byte that stand for 1
    ones_words, ones_scales = mx.quantize(mx.ones((1, 32)), group_size=group_size, bits=bits, mode=mode)
    per_word, n = 32 // bits, 1 << bits
    one_code, one_scale = ones_words[0, 0].item() & (n - 1), ones_scales[0, 0].item()

    def words(codes: mx.array) -> mx.array:  # codes (rows, k * per_word) packed as mx.quantize packs them
        shifted = codes.reshape(codes.shape[0], -1, per_word) << (mx.arange(per_word, dtype=mx.uint32) * bits)
        return mx.sum(shifted, axis=-1).astype(mx.uint32)

    def dequantize(codes: mx.array, scale_bytes: mx.array) -> mx.array:
        scales = mx.repeat(scale_bytes.astype(mx.uint8)[:, None], codes.shape[1] // group_size, axis=1)
        return mx.dequantize(words(codes), scales, group_size=group_size, bits=bits, mode=mode, dtype=mx.float32)

    width = max(n, 32)  # whole rows of 32 values at least: MLX's nvfp4 takes no shorter ones
    every_code = (mx.arange(width, dtype=mx.uint32) % n)[None]
    values = dequantize(every_code, mx.array([one_scale]))[0, :n]
    ones = mx.full((256, width), one_code, mx.uint32)
    scales = dequantize(ones, mx.arange(256))[:, 0] / values[one_code]
    return value_tables(values, values, scales)


class FloatCache(BlockKernelRoute, BlockCache):
    """Each token's K/V row as microscaling floats (codes in uint32 words, one uint8 scale per group)."""

    scheme = "float"
    block_tokens = 32
    body_step = 8  # the blocks' buffers grow 256 tokens at a time, as mlx-lm's caches do: a step writes in place
    OPTIONS = (
        Option("bits", 4, "value width: 4 (E2M1) or 8 (E4M3)", (4, 8)),
        Option("group_size", 32, "values sharing one 8-bit scale: 32 (mxfp4, mxfp8) or 16 (nvfp4)", (16, 32)),
        Option("rotation", 0, "1: a per-head Hadamard rotation first (as affine_rot)", (0, 1)),
        Option("kv_tail_tokens", 0, "newest tokens kept fp16"),
        Option("sink_tokens", 0, "first tokens kept fp16"),
    )

    @classmethod
    def complete(cls, values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        """nvfp4 is named by its group size alone (`float:g=16` means 4-bit values), and a (bits, group_size) pair
        that is no format is refused, naming the formats."""
        if given.get("group_size") == 16 and given.get("bits") is None:
            values = {**values, "bits": 4}
        if values["bits"] in (4, 8) and values["group_size"] in (16, 32):  # (else the option's own check says)
            float_format(values["bits"], values["group_size"])
        return values

    def __init__(self, layer: int | None = None, **options: Any):
        super().__init__(layer, **options)  # checked and completed (`complete`: the format's pair)
        self.mode = float_format(self.bits, self.group_size)

    def rotate(self, x: mx.array) -> mx.array:
        return mx.hadamard_transform(x) if self.rotation else x

    def unrotate(self, x: mx.array) -> mx.array:
        return mx.hadamard_transform(x) if self.rotation else x

    def scale_group(self, kind: str) -> tuple[int, int]:
        """One token's `group_size` channels share an 8-bit scale, in K and V."""
        return 1, self.group_size

    def encode(self, x: mx.array, kind: str) -> tuple[mx.array, mx.array]:
        return mx.quantize(x, group_size=self.group_size, bits=self.bits, mode=self.mode)

    def decode(self, parts: tuple[mx.array, mx.array], kind: str) -> mx.array:
        codes, scales = parts
        return mx.dequantize(codes, scales, group_size=self.group_size, bits=self.bits, mode=self.mode,
                             dtype=mx.float32)

    def matmul_codes(self) -> MatmulCodes | None:
        """The 4-bit formats' blocks as rows for `mx.quantized_matmul` (mxfp8's were slower that way than decoded)."""
        if self.bits != 4:
            return None
        options = {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}
        return MatmulCodes((options, options), self.rotate if self.rotation else None)

    def rotated_step(self) -> bool:
        """A CPU decode step of rotated blocks (mxfp8_rot: no `matmul_codes`) attends in the rotated space."""
        return bool(self.rotation)

    def kernel_layout(self) -> BlockLayout:
        """The blocks as affine_decode reads them: codes and byte scales looked up in the format's tables, no
        offsets, Hadamard-rotated with `rotation`."""
        body = [[codes.data, scales.data, scales.data] for codes, scales in self.body_buffers]
        return BlockLayout(body, (self.bits, self.bits), self.group_size, tables=format_tables(self.bits,
                           self.group_size), rotation="hadamard" if self.rotation else "none")


class FloatScheme(BlockScheme):
    """One scheme, three formats: the label names the format; the options are the class's (FloatCache.OPTIONS)."""

    def label(self, values: dict[str, Any]) -> str:
        """`mxfp4`, `nvfp4_rot`, `mxfp8 tail=128 sink=4`."""
        label = float_format(values["bits"], values["group_size"]) + ("_rot" if values["rotation"] else "")
        label += f" tail={values['kv_tail_tokens']}" if values["kv_tail_tokens"] else ""
        return with_sink(label, values)

    def spec_words(self) -> dict[str, dict[str, Any]]:
        """mxfp4, nvfp4, mxfp8 and their _rot twins."""
        return {name + rot: {"bits": b, "group_size": g, "rotation": int(bool(rot))}
                for (b, g), name in FORMATS.items() for rot in ("", "_rot")}


SCHEME = register_scheme(FloatScheme(
    "float", "microscaling floats per token (mxfp4, nvfp4, mxfp8 via mx.quantize), Hadamard rotation optional",
    cache_class=FloatCache, color="#e377c2",
    examples=({"bits": 4, "group_size": 16, "rotation": 1}, {"bits": 8, "kv_tail_tokens": 64}, {"sink_tokens": 4})))
