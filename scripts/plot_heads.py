#!/usr/bin/env python3
"""Plots a kvcal head profile (kvcal profile-heads --out HEADS.h5).

Writes four PNGs into --out-dir:
  stability_sorted.png   every KV head's stability, sorted, with the tau_stable
                         line (HeteroCache Fig. 1(c)); heads at or above it solid,
                         the rest dashed;
  similarity_sorted.png  the same for similarity and tau_sim (Fig. 1(d));
  role_counts.png        how many heads have each role (Fig. 6 style);
  role_map.png           layer x head map of the roles.

Usage: plot_heads.py HEADS.h5 --out-dir DIR [--title TEXT]
Needs h5py, numpy and matplotlib (Agg backend, no display).
"""
import argparse
import os
import sys

import h5py
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import BoundaryNorm, ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

ROLES = [(1, "anchor", "#4C72B0"), (2, "volatile", "#DD8452"), (3, "pivot", "#55A868"), (4, "satellite", "#C44E52")]


def attr(f, name, default=None):
    v = f.attrs.get(name, default)
    if isinstance(v, bytes):
        v = v.decode()
    return v


def sorted_curve(ax, values, tau, label, color):
    """Sorted values (descending); >= tau solid, < tau dashed; the tau line."""
    v = np.sort(values.ravel())[::-1]
    x = np.arange(len(v))
    above = v >= tau
    n_above = int(above.sum())
    if n_above:
        ax.plot(x[:n_above], v[:n_above], "-", color=color, lw=2.2, label=f"{label} >= tau ({n_above})")
    if n_above < len(v):
        # start the dashed part at the last solid point so that the curve is continuous
        s = max(n_above - 1, 0)
        ax.plot(x[s:], v[s:], "--", color=color, lw=2.2, label=f"{label} < tau ({len(v) - n_above})")
    ax.axhline(tau, color="0.3", lw=1.2, ls=":")
    ax.text(len(v) - 1, tau, f"tau = {tau:g}", ha="right", va="bottom", fontsize=10, color="0.2")
    ax.set_xlim(-0.5, len(v) - 0.5)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("KV heads, sorted")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", frameon=False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("heads")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--title", default=None, help="figure title prefix (default: the model name)")
    ap.add_argument("--dpi", type=int, default=130)
    a = ap.parse_args(argv)
    with h5py.File(a.heads, "r") as f:
        h = f["heads"]
        stability, similarity = h["stability"][()], h["similarity"][()]
        role, pivot = h["role"][()], h["pivot"][()]
        tau_stable = float(attr(f, "tau_stable", 0.5))
        tau_sim = float(attr(f, "tau_sim", 0.5))
        model = attr(f, "model", "") or os.path.basename(a.heads)
    title = a.title or model
    if len(title) > 60:
        title = title[:57] + "..."
    L, H = role.shape
    os.makedirs(a.out_dir, exist_ok=True)
    written = []

    def save(fig, name):
        path = os.path.join(a.out_dir, name)
        fig.savefig(path, dpi=a.dpi, bbox_inches="tight")
        plt.close(fig)
        written.append(path)

    # (a) and (b): sorted stability / similarity
    for values, tau, label, color, name in ((stability, tau_stable, "stability", "#4C72B0", "stability_sorted.png"),
                                           (similarity, tau_sim, "similarity", "#55A868", "similarity_sorted.png")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        sorted_curve(ax, values, tau, label, color)
        ax.set_title(f"{title}\n{label} of {L * H} KV heads ({L} layers x {H})", fontsize=10)
        save(fig, name)

    # (c): role counts
    counts = [int((role == code).sum()) for code, _, _ in ROLES]
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    bars = ax.bar([n for _, n, _ in ROLES], counts, color=[c for _, _, c in ROLES])
    total = max(sum(counts), 1)
    for b, c in zip(bars, counts):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{c}\n({100 * c / total:.0f}%)",
                ha="center", va="bottom", fontsize=10)
    ax.set_ylim(0, max(counts + [1]) * 1.25)
    ax.set_ylabel("KV heads")
    ax.set_title(f"{title}\nhead roles (tau_stable = {tau_stable:g}, tau_sim = {tau_sim:g})", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    save(fig, "role_counts.png")

    # (d): layer x head role map
    cmap = ListedColormap([c for _, _, c in ROLES])
    norm = BoundaryNorm([0.5, 1.5, 2.5, 3.5, 4.5], cmap.N)
    width = min(max(3.0 + 0.45 * H, 4.5), 16)
    height = min(max(1.5 + 0.28 * L, 3.0), 20)
    fig, ax = plt.subplots(figsize=(width, height))
    ax.imshow(role, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    if H * L <= 40 * 40:  # mark each satellite with its pivot's head index
        for l in range(L):
            for k in range(H):
                if role[l, k] == 4:
                    ax.text(k, l, str(pivot[l, k]), ha="center", va="center", fontsize=7, color="white")
    ax.set_xlabel("KV head" + (" (satellites show their pivot)" if H * L <= 1600 else ""))
    ax.set_ylabel("layer")
    ax.set_xticks(np.arange(H) if H <= 32 else np.linspace(0, H - 1, 9).astype(int))
    ax.set_yticks(np.arange(L) if L <= 40 else np.linspace(0, L - 1, 11).astype(int))
    ax.legend(handles=[Patch(color=c, label=n) for _, n, c in ROLES], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(f"{title}\nroles per layer and KV head", fontsize=10)
    save(fig, "role_map.png")

    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
