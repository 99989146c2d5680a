#!/usr/bin/env python3
"""Speed of the Python package against baselines in the same run.

Decode-step attention of one layer (9 query heads over 3 KV heads of 64
channels, S cached tokens) through kvcal.HexLayerCache (fp16 and hex4) and
kvcal.H2OEvictCache, against the same attention in NumPy (float32 matmuls on
the fp16 cache), plus the binding's per-call overhead (a 1-token cache).

Usage: PYTHONPATH=build/release/python python3 bench/bench_python.py [--tokens 4096] [--repeat 200]
"""
import argparse
import time

import numpy as np

import kvcal


def best_of(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e6, float(np.median(times)) * 1e6


def numpy_attend(q, k, v, scale, group):
    out = np.empty_like(q)
    for h in range(k.shape[0]):
        qs = q[h * group:(h + 1) * group]
        s = (qs @ k[h].T) * scale
        s = np.exp(s - s.max(axis=1, keepdims=True))
        s /= s.sum(axis=1, keepdims=True)
        out[h * group:(h + 1) * group] = s @ v[h]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=200)
    a = ap.parse_args()
    H, Hq, D, S = 3, 9, 64, a.tokens
    rng = np.random.default_rng(0)
    k = rng.standard_normal((H, S, D)).astype(np.float16)
    v = rng.standard_normal((H, S, D)).astype(np.float16)
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    out = np.empty((Hq, D), np.float32)
    (m,) = kvcal.generate_masks(96, D, row_degree=4, method="lift", seed=3)
    mask = kvcal.Mask(96, D, m.indptr, m.indices)
    rows = []
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    rows.append(("numpy float32 (baseline)", *best_of(lambda: numpy_attend(q, k32, v32, 0.125, 3), a.repeat)))
    for method in ("fp16", "hex4"):
        c = kvcal.HexLayerCache(H, D, method, mask if method == "hex4" else None)
        c.observe(rng.random((Hq, S)).astype(np.float32))
        c.append(k, v)
        rows.append((f"kvcal {method}", *best_of(lambda: c.attend(q, out=out), a.repeat)))
    e = kvcal.H2OEvictCache(H, Hq, D, 0.5)
    e.append(k, v)
    rows.append(("kvcal h2o-evict (budget 0.5)", *best_of(lambda: e.attend(q, out=out), a.repeat)))
    tiny = kvcal.HexLayerCache(H, D, "fp16")
    tiny.append(k[:, :1], v[:, :1])
    rows.append(("kvcal fp16, 1 token (call overhead)", *best_of(lambda: tiny.attend(q, out=out), a.repeat * 5)))
    print(f"decode attention, {Hq} query heads / {H} KV heads x {D} channels, {S} tokens")
    print(f"{'':40} {'best us':>10} {'median us':>10}")
    for name, best, med in rows:
        print(f"{name:40} {best:10.1f} {med:10.1f}")


if __name__ == "__main__":
    main()
