"""The transient memory of one `mx.fast.scaled_dot_product_attention` call for a 2048-token prompt chunk against a
long cache, by mask: mlx-lm's "causal" string, the same mask as a boolean array, and none.

    python benchmarks/sdpa_mask_memory.py

Prints, per context and mask, the peak memory above the inputs (`mx.get_peak_memory`): where it is the size of
the chunk's score matrix (32 heads x 2048 x T float32), the call built the scores rather than running fused.
"""

import mlx.core as mx

CHUNK, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 8, 128

for T in (32768, 131072):
    q = mx.random.normal((1, HEADS, CHUNK, HEAD_DIM)).astype(mx.float16)
    k = mx.random.normal((1, KV_HEADS, T, HEAD_DIM)).astype(mx.float16)
    mask = mx.arange(T - CHUNK, T)[:, None] >= mx.arange(T)[None]
    mx.eval(q, k, mask)
    for name, m in (("causal", "causal"), ("bool", mask), ("none", None)):
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        o = mx.fast.scaled_dot_product_attention(q, k, k, scale=HEAD_DIM**-0.5, mask=m)
        mx.eval(o)
        print(f"sdpa T={T} mask={name}: peak above inputs {(mx.get_peak_memory() - base) / 2**20:.0f} MiB "
              f"(output {o.nbytes / 2**20:.0f} MiB)", flush=True)
        del o
