"""A plug-in scheme defined only in tests/: symmetric rounding of rotated K/V, for tests/test_plugins.py.

`gmlx-lab --plugin tests/toy_scheme.py ...` (or `import toy_scheme`) registers it as "toy".
"""

import mlx.core as mx

import gmlx_lab


class ToyCache(gmlx_lab.BlockCache):
    """After a Hadamard rotation, each token's row in groups of 32 channels: int8 codes, one fp16 scale a group."""

    scheme = "toy"
    block_tokens = 16
    OPTIONS = (
        gmlx_lab.Option("bits", 8, "code width", (4, 8)),
        gmlx_lab.Option("kv_tail_tokens", 16, "newest tokens kept fp16"),
        gmlx_lab.Option("sink_tokens", 4, "first tokens kept fp16"),
    )
    rotate = unrotate = staticmethod(mx.hadamard_transform)

    def encode(self, x: mx.array, kind: str) -> tuple[mx.array, mx.array]:
        groups = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)  # head dims not a multiple of 32 fail here
        top = 2 ** (self.bits - 1) - 1
        scale = mx.maximum(mx.max(mx.abs(groups), axis=-1, keepdims=True) / top, 1e-4).astype(mx.float16)
        return mx.round(groups / scale.astype(mx.float32)).astype(mx.int8), scale

    def decode(self, parts: tuple[mx.array, mx.array], kind: str) -> mx.array:
        codes, scale = parts
        x = codes.astype(mx.float32) * scale.astype(mx.float32)
        return x.reshape(*x.shape[:-2], -1)


SCHEME = gmlx_lab.register_scheme(gmlx_lab.BlockScheme(
    "toy", "symmetric int8 codes of rotated rows, one fp16 scale per 32 channels (a test plug-in)",
    cache_class=ToyCache, color="#2ca02c", examples=({}, {"bits": 4, "kv_tail_tokens": 0, "sink_tokens": 0})))
