#!/usr/bin/env python3
"""Baseline for the mask benchmarks: the usual SciPy pipeline.

A random r-lift of K(d2, d1) built with NumPy, sigma2 by scipy.sparse.linalg.svds
(Lanczos; not rigorous), and the dense check with numpy.linalg.eigvalsh on the
smaller Gram matrix (floating point; proves no bound). Prints one JSON line per
stage with seconds and peak memory.

Usage: bench_baseline_scipy.py ROWS COLS D1 [--no-dense]
"""
import json
import resource
import sys
import time

import numpy as np
import scipy.sparse as sp
from scipy.sparse.linalg import svds


def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def lift(rows, cols, d1, rng):
    r = cols // d1
    d2 = rows // r
    indices = np.empty((rows, d1), dtype=np.int32)
    for a in range(d2):
        for b in range(d1):
            indices[a * r:(a + 1) * r, b] = b * r + rng.permutation(r)
    indptr = np.arange(0, rows * d1 + 1, d1, dtype=np.int64)
    return sp.csr_matrix((np.ones(rows * d1), indices.ravel(), indptr), shape=(rows, cols)), d2


def main():
    rows, cols, d1 = (int(x) for x in sys.argv[1:4])
    dense = "--no-dense" not in sys.argv
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    b, d2 = lift(rows, cols, d1, rng)
    t1 = time.perf_counter()
    s = svds(b, k=2, return_singular_vectors=False)
    sigma2 = float(np.sort(s)[0])
    t2 = time.perf_counter()
    tau = np.sqrt(d1 - 1) + np.sqrt(d2 - 1)
    print(json.dumps({"stage": "lift+svds", "shape": f"{rows}x{cols}", "d1": d1, "d2": d2,
                      "seconds": round(t2 - t0, 3), "lift_seconds": round(t1 - t0, 3),
                      "sigma2": sigma2, "tau": float(tau), "peak_rss_MiB": round(peak_mib(), 1)}))
    if dense:
        t3 = time.perf_counter()
        g = (b.T @ b).toarray() if cols <= rows else (b @ b.T).toarray()
        ev = np.linalg.eigvalsh(g)
        t4 = time.perf_counter()
        print(json.dumps({"stage": "dense eigvalsh", "seconds": round(t4 - t3, 3),
                          "sigma2": float(np.sqrt(max(ev[-2], 0.0))), "peak_rss_MiB": round(peak_mib(), 1)}))


if __name__ == "__main__":
    main()
