#!/usr/bin/env python3
"""Token entropy/varentropy throughput: kvcal against NumPy, on the same data, in one run.

Writes float32 logits [rows, V] (default 512 x 128,256, ~260 MB) to out/bench/logits.f32,
times a straightforward NumPy implementation (log-sum-exp, float64 accumulation), then runs
build/release/bin/bench_entropy on the same file (memory-read bandwidth and kvcal's token
statistics with 1 and 2 threads) and prints tokens per second and the ratios.

Usage: scripts/bench_entropy.py [--rows 512] [--vocab 128256] [--bench build/release/bin/bench_entropy]
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def numpy_token_stats(z):
    """Entropy and varentropy (nats) per row of logits z [rows, V], NumPy only."""
    m = z.max(axis=1, keepdims=True)
    x = (z - m).astype(np.float64)
    e = np.exp(x)
    s = e.sum(axis=1)
    lse = np.log(s)
    p = e / s[:, None]
    logp = x - lse[:, None]
    h = -(p * logp).sum(axis=1)
    v = (p * (logp + h[:, None]) ** 2).sum(axis=1)
    return h, v


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--bench", default="build/release/bin/bench_entropy")
    ap.add_argument("--out-dir", default="out/bench")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, "logits.f32")
    rng = np.random.default_rng(1)
    z = (3.0 * rng.standard_normal((a.rows, a.vocab))).astype(np.float32)
    z.tofile(path)
    nbytes = z.nbytes

    numpy_tps = []
    for _ in range(2):
        t0 = time.perf_counter()
        for r0 in range(0, a.rows, 64):  # blocks keep NumPy's temporaries in memory bounds
            numpy_token_stats(z[r0:r0 + 64])
        numpy_tps.append(a.rows / (time.perf_counter() - t0))
    numpy_best = max(numpy_tps)

    env = dict(os.environ, KVCAL_BENCH_LOGITS=path, KVCAL_BENCH_VOCAB=str(a.vocab))
    out = subprocess.run([a.bench, "--benchmark_format=json"], env=env, check=True, capture_output=True, text=True)
    results = {b["name"]: b for b in json.loads(out.stdout)["benchmarks"]}
    bw = {k: v["bytes_per_second"] for k, v in results.items() if k.startswith("streaming_read")}
    tok = {k: v for k, v in results.items() if k.startswith("token_stats")}
    best_bw = max(bw.values())
    print(f"data: {a.rows} x {a.vocab} float32 logits, {nbytes / 1e6:.0f} MB")
    print(f"memory-read bandwidth (streaming sum): " + ", ".join(f"{k}: {v / 1e9:.2f} GB/s" for k, v in bw.items()))
    print(f"NumPy:  {numpy_best:,.0f} tokens/s ({numpy_best * a.vocab * 4 / 1e9:.2f} GB/s)")
    summary = {"rows": a.rows, "vocab": a.vocab, "numpy_tokens_per_s": numpy_best, "bandwidth_bytes_per_s": bw}
    for k, v in tok.items():
        tps = v["tokens_per_s"]
        print(f"kvcal {k}: {tps:,.0f} tokens/s ({v['bytes_per_second'] / 1e9:.2f} GB/s) = "
              f"{v['bytes_per_second'] / best_bw:.0%} of the best read bandwidth, {tps / numpy_best:.1f}x NumPy")
        summary[k] = {"tokens_per_s": tps, "bytes_per_s": v["bytes_per_second"]}
    with open(os.path.join(a.out_dir, "entropy.json"), "w") as f:
        json.dump(summary, f, indent=1)
    os.remove(path)


if __name__ == "__main__":
    sys.exit(main())
