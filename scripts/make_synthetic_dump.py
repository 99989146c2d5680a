#!/usr/bin/env python3
"""Writes a synthetic kvcal.attention_dump (format_version 1) of a requested size.

Rows are valid softmax rows (non-negative, summing to 1, zero padding after
position N+t) with planted HeteroCache structure. Per sample, layer and KV head
the logits over the keys are

    logit_t = scale * (sqrt(1 - c^2) * A + c * B_block(t) + sigma * noise_t) + sink + local

with A a fixed per-head key profile, B_0 the prefill's drift vector and
B_1, B_2, ... fresh drift vectors every `--block` decode steps. The drift c
sets the head's kind:
  * stable heads (c ~ 0.15-0.35): the same top-k keys at prefill and decode
    (high stability, anchors);
  * shifting heads (c ~ 0.8-1.0): the top-k keys move every block (volatile);
  * redundant groups: a head may copy an earlier head of its layer (A, B, c),
    giving high pairwise overlap (pivot + satellites).
Query heads of a KV group share its logits up to their own small noise.
Every sample redraws the vectors (the kinds per layer/head stay the same).

Datasets are written in slabs of (step block, layer), chunked
(min(T, 16), 1, H, N+T) for decode and (1, H, N) for prefill; gzip is off
unless --compress (gzip + shuffle). Memory stays at a few slabs.

Example:
  make_synthetic_dump.py --layers 24 --q-heads 16 --kv-heads 4 --samples 4 \\
      --prompt-len 4096 --steps 64 --dtype float16 --out big.h5
Lists give per-sample sizes (cycled): --prompt-len 37,50,29 --steps 9,4,12.
"""
import argparse
import os
import sys
import time

import h5py
import numpy as np


def int_list(text):
    return [int(x) for x in text.split(",") if x]


def head_kinds(rng, layers, hkv, p_stable, p_redundant):
    """Per layer and KV head: drift c and the head it copies (-1: none)."""
    drift = np.where(rng.random((layers, hkv)) < p_stable,
                     rng.uniform(0.15, 0.35, (layers, hkv)), rng.uniform(0.8, 1.0, (layers, hkv)))
    # a few intermediate heads so that the stability curve is a continuum
    mid = rng.random((layers, hkv)) < 0.15
    drift[mid] = rng.uniform(0.45, 0.75, mid.sum())
    copy = np.full((layers, hkv), -1)
    for l in range(layers):
        for h in range(1, hkv):
            if rng.random() < p_redundant:
                src = int(rng.integers(0, h))
                copy[l, h] = src if copy[l, src] < 0 else copy[l, src]
    return drift, copy


def softmax_rows(logits, valid):
    """Softmax over the first valid[r] entries of each row (in place, float32)."""
    W = logits.shape[-1]
    pad = np.arange(W)[None, :] >= valid.reshape(-1, 1)
    flat = logits.reshape(-1, W)
    flat[pad] = -np.inf
    flat -= flat.max(axis=1, keepdims=True)
    np.exp(flat, out=flat)
    flat /= flat.sum(axis=1, keepdims=True)
    return logits


class HeadVectors:
    """The per-sample key profiles of one layer: A [hkv, W] and B [blocks, hkv, W]."""

    def __init__(self, rng, hkv, width, blocks, drift, copy):
        self.A = rng.standard_normal((hkv, width), dtype=np.float32)
        self.B = rng.standard_normal((blocks, hkv, width), dtype=np.float32)
        self.c = drift.astype(np.float32).copy()
        for h in range(hkv):
            if copy[h] >= 0:
                self.A[h] = self.A[copy[h]]
                self.B[:, h] = self.B[:, copy[h]]
                self.c[h] = self.c[copy[h]]

    def logits(self, block, width):
        c = self.c[:, None]
        return np.sqrt(1 - c * c) * self.A[:, :width] + c * self.B[block][:, :width]


def expand_q(kv_logits, group, rng, sigma):
    """[..., hkv, W] -> [..., hkv*group, W] with independent noise per query head."""
    x = np.repeat(kv_logits, group, axis=-2)
    x += sigma * rng.standard_normal(x.shape, dtype=np.float32)
    return x


def write_sample(f, rng, name, n, T, a, drift, copy, dtype, comp):
    L, hkv = a.layers, a.kv_heads
    H = a.kv_heads if a.store == "kv" else a.q_heads
    group = H // hkv
    W = n + T
    g = f["samples"].create_group(name)
    g.attrs["prompt_len"] = np.int64(n)
    g.attrs["num_decode_steps"] = np.int64(T)
    tb = min(T, a.step_block)
    pre = g.create_dataset("prefill", (L, H, n), dtype=dtype, chunks=(1, H, n), **comp)
    dec = g.create_dataset("decode", (T, L, H, W), dtype=dtype, chunks=(tb, 1, H, W), **comp)
    blocks = T // a.block + 2
    scale, sigma = np.float32(a.scale), np.float32(a.sigma)
    for l in range(L):
        vec = HeadVectors(rng, hkv, W, blocks, drift[l], copy[l])
        # prefill: the last prompt token over the n prompt keys
        x = expand_q(vec.logits(0, n), group, rng, sigma) * scale
        x[:, 0] += a.sink
        x[:, max(0, n - 8):n] += a.local
        pre[l] = softmax_rows(x, np.full(H, n)).astype(dtype)
        # decode, one chunk-aligned slab of steps at a time
        for t0 in range(0, T, tb):
            t1 = min(T, t0 + tb)
            steps = np.arange(t0, t1)
            base = np.stack([vec.logits(1 + t // a.block, W) for t in steps])     # [s, hkv, W]
            x = expand_q(base, group, rng, sigma) * scale                          # [s, H, W]
            x[:, :, 0] += a.sink
            pos = np.arange(W)
            valid = n + steps + 1
            recent = (pos[None, :] >= valid[:, None] - 8) & (pos[None, :] < valid[:, None])
            x += (a.local * recent)[:, None, :].astype(np.float32)
            softmax_rows(x, np.repeat(valid, H))
            dec[t0:t1, l] = x.astype(dtype)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--prompt-len", type=int_list, default=[256], help="N, or a comma list cycled over samples")
    ap.add_argument("--steps", type=int_list, default=[16], help="T, or a comma list cycled over samples")
    ap.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    ap.add_argument("--store", choices=["q", "kv"], default="q", help="store query heads (default) or KV heads")
    ap.add_argument("--p-stable", type=float, default=0.5, help="share of stable heads")
    ap.add_argument("--p-redundant", type=float, default=0.3, help="chance a head copies an earlier one")
    ap.add_argument("--block", type=int, default=8, help="decode steps between drift changes")
    ap.add_argument("--scale", type=float, default=2.0, help="logit scale (peakiness)")
    ap.add_argument("--sigma", type=float, default=0.25, help="per-step, per-query-head noise")
    ap.add_argument("--sink", type=float, default=4.0, help="extra logit of position 0")
    ap.add_argument("--local", type=float, default=1.5, help="extra logit of the 8 most recent keys")
    ap.add_argument("--step-block", type=int, default=16, help="decode steps per chunk / written slab")
    ap.add_argument("--compress", action="store_true", help="gzip + shuffle (default: uncompressed)")
    ap.add_argument("--string-attrs", choices=["fixed", "vlen"], default="fixed",
                    help="root string attributes as fixed-length ASCII (default) or as h5py's variable-length "
                         "UTF-8 (what scripts/record_attention.py writes)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", default="synthetic")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.kv_heads < 1 or a.q_heads % a.kv_heads:
        ap.error("--q-heads must be a multiple of --kv-heads")
    if min(a.prompt_len) < 1 or min(a.steps) < 1 or a.layers < 1 or a.samples < 1:
        ap.error("sizes must be positive")
    dtype = np.float16 if a.dtype == "float16" else np.float32
    comp = dict(compression="gzip", compression_opts=4, shuffle=True) if a.compress else {}
    rng = np.random.default_rng(a.seed)
    drift, copy = head_kinds(rng, a.layers, a.kv_heads, a.p_stable, a.p_redundant)
    t0 = time.perf_counter()
    tmp = a.out + ".tmp.%d" % os.getpid()
    score_bytes = 0
    with h5py.File(tmp, "w") as f:
        # Fixed-length ASCII strings by default: kvcal built on HDF5 1.10
        # fails to read variable-length UTF-8 string attributes (h5py's default).
        string = (lambda v: np.bytes_(v.encode())) if a.string_attrs == "fixed" else str
        f.attrs["format"] = string("kvcal.attention_dump")
        f.attrs["format_version"] = np.int64(1)
        f.attrs["model"] = string(a.model)
        f.attrs["num_layers"] = np.int64(a.layers)
        f.attrs["num_q_heads"] = np.int64(a.q_heads)
        f.attrs["num_kv_heads"] = np.int64(a.kv_heads)
        f.attrs["command_line"] = string(" ".join(["make_synthetic_dump.py"] + sys.argv[1:]))
        f.create_group("samples")
        for s in range(a.samples):
            n = a.prompt_len[s % len(a.prompt_len)]
            T = a.steps[s % len(a.steps)]
            write_sample(f, rng, f"sample_{s:03d}", n, T, a, drift, copy, dtype, comp)
            H = a.kv_heads if a.store == "kv" else a.q_heads
            score_bytes += (a.layers * H * n + T * a.layers * H * (n + T)) * np.dtype(dtype).itemsize
    os.replace(tmp, a.out)
    size = os.path.getsize(a.out)
    print(f"wrote {a.out}: {size} bytes on disk ({size / 1e9:.3f} GB), {score_bytes} bytes of attention scores, "
          f"{a.samples} samples x {a.layers} layers x {a.q_heads}/{a.kv_heads} heads, {a.dtype}, "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
