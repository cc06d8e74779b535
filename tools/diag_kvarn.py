"""Per-split comparison of the kvarn_decode kernel with its MLX emulation, on a GPU backend.

Prints, for a few shapes (head dims, GQA, query tokens, widths), each split's relative error and the
first log-sum-exps of kernel and emulation: where a kernel change goes wrong, which units it breaks.
Usage (where MLX runs on a GPU): python tools/diag_kvarn.py
"""
import mlx.core as mx

from gmlx_lab.cache.kvarn import KVarNCache
from gmlx_lab.kernels.decode import group_queries, kvarn_partials

for d, hq, hkv, lq, kb, vb, tokens, tail in [(128, 4, 2, 1, 6, 6, 128 + 9 * 128 + 200, 256),
                                              (128, 16, 2, 1, 4, 4, 128 + 3 * 128 + 77, 128),
                                              (128, 8, 2, 4, 6, 6, 128 + 3 * 128 + 77, 128),
                                              (256, 8, 2, 1, 3, 5, 128 + 3 * 128 + 70, 128)]:
    mx.random.seed(0)
    k = mx.random.normal((1, hkv, tokens, d))
    v = mx.random.normal((1, hkv, tokens, d))
    c = KVarNCache(kb, vb, kv_tail_tokens=tail)
    c.update_and_fetch(k, v)
    qg = group_queries(mx.hadamard_transform(mx.random.normal((1, hq, lq, d))), hkv)
    ko, kl = kvarn_partials(qg, d**-0.5, c, lq, lq > 1, per_warp=1)
    eo, el = kvarn_partials(qg, d**-0.5, c, lq, lq > 1, per_warp=1, emulate=True)
    print(f"case d={d} hq={hq} hkv={hkv} L={lq} bits={kb}/{vb} records={c.n_records} shapes {ko.shape} {eo.shape}")
    for sp in range(ko.shape[1]):
        a, b = ko[:, sp], eo[:, sp]
        rel = (mx.linalg.norm((a - b).flatten()) / mx.linalg.norm(b.flatten())).item()
        print(f"  split {sp}: rel {rel:.2e}  lse kernel {kl[0, sp, :4].tolist()} emul {el[0, sp, :4].tolist()}")
