#!/usr/bin/env python3
"""NumPy reference for `kvcal profile-heads` (HeteroCache head profiling).

An independent, straightforward implementation of the same profiling, used by
tests/python/test_profile_reference.py to check kvcal's numerics and by
scripts/bench_profile_heads.sh as the baseline. It reads one layer of one
sample at a time with h5py, so memory stays bounded whatever the dump's size.

Semantics (those of kvcal, lib/src/profile/heads.cpp):
  * rows are read as float32 (float16 converted exactly) and checked: finite,
    non-negative, summing to 1 within 2e-2, zero padding after N+t+1;
  * GQA: KV head g combines query heads [g*G, (g+1)*G), G = Hq/Hkv, by mean
    (float32, summed in head order, times float32(1/G)) or max;
  * pooling: centred average over `pool` positions, left = pool//2,
    right = pool-1-left, averaging only the positions inside the row
    (window sums in float64, the mean rounded to float32);
  * top-k: k = min(topk, len), or ceil(topk_frac*len) clipped to [1, len];
    ties at the k-th value: the lower position wins;
  * overlap |A n B| / min(|A|, |B|); stability = median over steps of the
    overlap of K_t with K_prefill; pairwise = median over steps of the overlap
    of two heads' K_t; similarity = median over steps of the best overlap with
    another head (0 for a single head); the median of an even count is the
    mean of the two middle values;
  * per-sample scores (float32) averaged over all samples of all dumps;
  * roles per layer: greedy star clustering on the graph pairwise >= tau_sim
    (with --order similar-first only heads with similarity >= tau_sim take
    part); pivot = unassigned head with most unassigned neighbours (ties:
    lowest index), its unassigned neighbours become satellites; the rest
    anchor (stability >= tau_stable) or volatile. Codes 1 anchor, 2 volatile,
    3 pivot, 4 satellite;
  * budgets over all L*Hkv heads of the model: 1 for pivot and volatile heads;
    anchors and satellites share budget*N - N_full in proportion to
    1/max(stability, 1e-3), capped at 1 (water filling).

Usage:
  profile_heads_reference.py DUMP.h5 [DUMP.h5 ...] --out REF.h5 [--topk 1024]
      [--topk-frac F] [--pool 5] [--tau-stable 0.5] [--tau-sim 0.5]
      [--budget 0.5] [--gqa mean|max] [--order appendix|similar-first]
"""
import argparse
import math
import os
import sys
import time

import h5py
import numpy as np

ANCHOR, VOLATILE, PIVOT, SATELLITE = 1, 2, 3, 4
ROW_TOLERANCE = 2e-2
STABILITY_FLOOR = 1e-3


class DumpError(Exception):
    pass


# ---------------------------------------------------------------- reading ---

def open_dump(path):
    f = h5py.File(path, "r")
    fmt = f.attrs.get("format")
    if isinstance(fmt, bytes):
        fmt = fmt.decode()
    if fmt != "kvcal.attention_dump" or int(f.attrs.get("format_version", -1)) != 1:
        raise DumpError(f"{path}: not a kvcal.attention_dump version 1")
    L = int(f.attrs["num_layers"])
    hq = int(f.attrs["num_q_heads"])
    hkv = int(f.attrs["num_kv_heads"])
    if hkv < 1 or hq % hkv:
        raise DumpError(f"{path}: {hq} query heads do not split into {hkv} KV heads")
    samples = []
    for name in sorted(f["samples"].keys()):  # HDF5 name order, as kvcal
        g = f["samples"][name]
        n = int(g.attrs["prompt_len"])
        pre, dec = g["prefill"], g["decode"]
        T, H = dec.shape[0], pre.shape[1]
        if pre.shape != (L, H, n) or dec.shape != (T, L, H, n + T) or H not in (hq, hkv) or T < 1:
            raise DumpError(f"{path}: sample '{name}': bad shapes {pre.shape} / {dec.shape}")
        samples.append((name, n, T, H))
    return f, L, hq, hkv, samples


def check_rows(rows, valid, where):
    """rows [R, W] float32 with valid[R] leading entries; padding must be 0."""
    W = rows.shape[-1]
    inside = np.arange(W)[None, :] < valid[:, None]
    if not np.isfinite(rows).all():
        raise DumpError(f"{where}: non-finite value")
    if (rows < 0).any():
        raise DumpError(f"{where}: negative value")
    if (rows[~inside] != 0).any():
        raise DumpError(f"{where}: non-zero padding")
    sums = rows.sum(axis=-1, dtype=np.float64)
    bad = np.abs(sums - 1.0) > ROW_TOLERANCE
    if bad.any():
        raise DumpError(f"{where}: a row sums to {sums[bad][0]:.6f}, not 1")


def reduce_gqa(x, hkv, how):
    """[..., H, W] -> [..., hkv, W]: consecutive groups of H/hkv heads."""
    H = x.shape[-2]
    if H == hkv:
        return x
    G = H // hkv
    g = x.reshape(x.shape[:-2] + (hkv, G, x.shape[-1]))
    if how == "max":
        return g.max(axis=-2)
    out = g[..., 0, :].copy()
    for m in range(1, G):  # float32, in head order (as kvcal)
        out += g[..., m, :]
    out *= np.float32(1.0) / np.float32(G)
    return out


def read_layer(f, sample, layer, hkv, gqa, check=True):
    """Prefill [hkv, n] and decode [T, hkv, n+T] of one layer, float32."""
    name, n, T, H = sample
    g = f["samples"][name]
    pre = g["prefill"][layer].astype(np.float32)          # [H, n]
    dec = g["decode"][:, layer].astype(np.float32)        # [T, H, n+T]
    if check:
        where = f"{f.filename}: sample '{name}', layer {layer}"
        check_rows(pre, np.full(H, n), where + ", prefill")
        valid = np.repeat(n + 1 + np.arange(T), H)
        check_rows(dec.reshape(T * H, n + T), valid, where + ", decode")
    return reduce_gqa(pre, hkv, gqa), reduce_gqa(dec, hkv, gqa)


# ---------------------------------------------------------------- scoring ---

def pool_rows(x, lengths, pool):
    """Centred average pooling of rows x [R, W] (row r valid over lengths[r]
    leading positions, zero beyond) -> float32 [R, W]; -inf past each row."""
    R, W = x.shape
    pos = np.arange(W)
    if pool <= 1:
        out = x.astype(np.float32, copy=True)
    else:
        left, right = pool // 2, pool - 1 - pool // 2
        padded = np.zeros((R, W + pool - 1), dtype=np.float64)
        padded[:, left:left + W] = x
        sums = padded[:, 0:W].copy()
        for j in range(1, pool):
            sums += padded[:, j:j + W]
        hi = np.minimum(lengths[:, None] - 1, pos[None, :] + right)
        lo = np.maximum(0, pos - left)[None, :]
        out = (sums / np.maximum(hi - lo + 1, 1)).astype(np.float32)  # count <= 0 only past the row
    out[pos[None, :] >= lengths[:, None]] = -np.inf
    return out


def topk_for_len(length, topk, topk_frac):
    if topk_frac > 0:
        return min(max(int(math.ceil(topk_frac * length)), 1), length)
    return min(max(topk, 1), length)


def topk_mask(v, k):
    """Boolean [R, W]: the k largest of each row of v (ties: lower index)."""
    R, W = v.shape
    if k >= W:
        return np.ones((R, W), dtype=bool)
    thr = np.partition(v, W - k, axis=1)[:, W - k]       # k-th largest
    above = v > thr[:, None]
    tied = v == thr[:, None]
    need = k - above.sum(axis=1)
    return above | (tied & (np.cumsum(tied, axis=1) <= need[:, None]))


def top_sets(rows, lengths, pool, topk, topk_frac):
    """Top-k sets (bool [R, W]) of the pooled rows and their sizes k[R]."""
    pooled = pool_rows(rows, lengths, pool)
    ks = np.array([topk_for_len(int(n), topk, topk_frac) for n in lengths])
    sets = np.zeros(rows.shape, dtype=bool)
    for k in np.unique(ks):  # rows sharing a k are selected together
        r = np.nonzero(ks == k)[0]
        sets[r] = topk_mask(pooled[r], int(k))
    return sets, ks


def layer_overlaps(prefill, decode, pool, topk, topk_frac):
    """prefill [H, n], decode [T, H, n+T] -> stability [H], similarity [H],
    pairwise [H, H] (float32) of one sample's layer."""
    H, n = prefill.shape
    T, W = decode.shape[0], decode.shape[2]
    pre_sets, pre_k = top_sets(prefill, np.full(H, n), pool, topk, topk_frac)
    lengths = np.repeat(n + 1 + np.arange(T), H)
    sets, ks = top_sets(decode.reshape(T * H, W), lengths, pool, topk, topk_frac)
    sets = sets.reshape(T, H, W)
    k_t = ks.reshape(T, H)[:, 0].astype(np.float64)     # same k for all heads of a step

    inter = (sets[:, :, :n] & pre_sets[None]).sum(axis=2)            # [T, H]
    stab_t = inter / np.minimum(k_t[:, None], pre_k[None, :])
    s = sets.astype(np.float32)
    pair_t = np.matmul(s, s.transpose(0, 2, 1)).astype(np.float64) / k_t[:, None, None]  # [T, H, H]
    idx = np.arange(H)
    pair_t[:, idx, idx] = 1.0

    stability = np.median(stab_t, axis=0)
    pairwise = np.median(pair_t, axis=0)
    if H > 1:
        others = pair_t.copy()
        others[:, idx, idx] = 0.0
        similarity = np.median(others.max(axis=2), axis=0)
    else:
        similarity = np.zeros(H)
    return stability.astype(np.float32), similarity.astype(np.float32), pairwise.astype(np.float32)


# ------------------------------------------------------ roles and budgets ---

def classify_layer(stability, similarity, pairwise, tau_stable, tau_sim, order="appendix"):
    H = len(stability)
    eligible = np.ones(H, dtype=bool) if order == "appendix" else (similarity.astype(np.float64) >= tau_sim)
    pw = pairwise.astype(np.float64)
    adj = (pw >= tau_sim) & (pw.T >= tau_sim) & eligible[:, None] & eligible[None, :]
    np.fill_diagonal(adj, False)
    role = np.zeros(H, dtype=np.int8)
    pivot = np.full(H, -1, dtype=np.int32)
    assigned = np.zeros(H, dtype=bool)
    while True:
        degree = (adj & ~assigned[None, :]).sum(axis=1)
        degree[assigned] = 0
        best = int(np.argmax(degree))  # first maximum: lowest index
        if degree[best] == 0:
            break
        sats = np.nonzero(adj[best] & ~assigned)[0]
        assigned[best] = True
        role[best], pivot[best] = PIVOT, best
        assigned[sats] = True
        role[sats], pivot[sats] = SATELLITE, best
    rest = ~assigned
    role[rest] = np.where(stability[rest].astype(np.float64) >= tau_stable, ANCHOR, VOLATILE)
    return role, pivot


def allocate_budgets(role, stability, budget, floor=STABILITY_FLOOR):
    """Budget ratios for all heads (any shape); see the module docstring."""
    role = role.ravel()
    ratio = np.ones(role.shape, dtype=np.float64)
    comp = np.nonzero((role == ANCHOR) | (role == SATELLITE))[0]
    total = role.size
    full = total - comp.size
    pool = budget * total - full
    if comp.size == 0:
        return ratio.astype(np.float32)
    if not pool > 1e-9 * total:
        raise ValueError(f"budget {budget} is too small: {full} of {total} heads keep their full cache; "
                         f"the budget must exceed {full / total:.4f}")
    w = 1.0 / np.maximum(stability.ravel()[comp].astype(np.float64), floor)
    r = np.zeros(comp.size)
    capped = np.zeros(comp.size, dtype=bool)
    remaining = max(pool, 0.0)
    while True:  # water filling at the cap of 1
        free = ~capped
        wsum = w[free].sum()
        if wsum == 0:
            break
        r[free] = remaining * w[free] / wsum
        over = free & (r > 1.0)
        if not over.any():
            break
        r[over] = 1.0
        capped |= over
        remaining -= over.sum()
    ratio[comp] = np.minimum(r, 1.0)
    return ratio.astype(np.float32)


# ------------------------------------------------------------------ driver ---

def profile(paths, topk=1024, topk_frac=0.0, pool=5, tau_stable=0.5, tau_sim=0.5, budget=0.5,
            gqa="mean", order="appendix", check=True, verbose=False):
    if not 1 <= pool <= 4096:
        raise ValueError(f"--pool {pool} must lie in [1, 4096]")
    if topk < 1 or not 0 <= topk_frac <= 1:
        raise ValueError("--topk must be >= 1 and --topk-frac in [0, 1]")
    if not (0 <= tau_stable <= 1 and 0 <= tau_sim <= 1 and 0 < budget <= 1):
        raise ValueError("thresholds must lie in [0, 1] and --budget in (0, 1]")
    files, shape = [], None
    for p in paths:
        f, L, hq, hkv, samples = open_dump(p)
        if shape is None:
            shape = (L, hq, hkv)
        elif shape != (L, hq, hkv):
            raise DumpError(f"{p}: L x Hq x Hkv = {(L, hq, hkv)} differs from {shape}")
        files.append((f, samples))
    L, hq, hkv = shape
    stab = np.zeros((L, hkv))
    sim = np.zeros((L, hkv))
    pair = np.zeros((L, hkv, hkv))
    count = 0
    t0 = time.perf_counter()
    for f, samples in files:
        for sample in samples:
            if topk_frac == 0 and topk >= sample[1]:
                print(f"warning: --topk {topk} covers whole rows of sample '{sample[0]}'", file=sys.stderr)
            for l in range(L):
                pre, dec = read_layer(f, sample, l, hkv, gqa, check)
                s, m, pw = layer_overlaps(pre, dec, pool, topk, topk_frac)
                stab[l] += s
                sim[l] += m
                pair[l] += pw
            count += 1
            if verbose:
                print(f"profiled sample {count} ('{sample[0]}') after {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr)
    for f, _ in files:
        f.close()
    inv = 1.0 / count
    stability = (stab * inv).astype(np.float32)
    similarity = (sim * inv).astype(np.float32)
    pairwise = (pair * inv).astype(np.float32)
    role = np.zeros((L, hkv), dtype=np.int8)
    pivot = np.zeros((L, hkv), dtype=np.int32)
    for l in range(L):
        role[l], pivot[l] = classify_layer(stability[l], similarity[l], pairwise[l], tau_stable, tau_sim, order)
    budget_ratio = allocate_budgets(role, stability, budget).reshape(L, hkv)
    return {"stability": stability, "similarity": similarity, "role": role, "pivot": pivot,
            "budget_ratio": budget_ratio, "pairwise_overlap": pairwise, "num_samples": count}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dumps", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--topk", type=int, default=1024)
    ap.add_argument("--topk-frac", type=float, default=0.0)
    ap.add_argument("--pool", type=int, default=5)
    ap.add_argument("--tau-stable", type=float, default=0.5)
    ap.add_argument("--tau-sim", type=float, default=0.5)
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--gqa", choices=["mean", "max"], default="mean")
    ap.add_argument("--order", choices=["appendix", "similar-first"], default="appendix")
    ap.add_argument("--no-check", action="store_true", help="skip the row checks (kvcal always checks)")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    try:
        p = profile(a.dumps, a.topk, a.topk_frac, a.pool, a.tau_stable, a.tau_sim, a.budget, a.gqa, a.order,
                    check=not a.no_check, verbose=a.verbose)
    except (DumpError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tmp = a.out + ".tmp.%d" % os.getpid()
    with h5py.File(tmp, "w") as f:
        f.attrs["format"] = "kvcal.head_profile.reference"
        f.attrs["num_samples"] = p["num_samples"]
        for key, val in dict(topk=a.topk, topk_frac=a.topk_frac, pool_kernel=a.pool, tau_stable=a.tau_stable,
                             tau_sim=a.tau_sim, budget=a.budget, gqa=a.gqa, taxonomy_order=a.order).items():
            f.attrs[key] = val
        g = f.create_group("heads")
        for key in ("stability", "similarity", "role", "pivot", "budget_ratio", "pairwise_overlap"):
            g.create_dataset(key, data=p[key])
    os.replace(tmp, a.out)
    role = p["role"]
    print(f"{role.shape[0]} layers x {role.shape[1]} KV heads, {p['num_samples']} samples: "
          + ", ".join(f"{n} {int((role == c).sum())}" for c, n in
                      ((ANCHOR, "anchor"), (VOLATILE, "volatile"), (PIVOT, "pivot"), (SATELLITE, "satellite")))
          + f"; mean budget {float(p['budget_ratio'].mean()):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
