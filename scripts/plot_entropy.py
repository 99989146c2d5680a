#!/usr/bin/env python3
"""CHESS Figure 4 style density plot of a kvcal entropy calibration.

Reads ENTROPY.h5 (format kvcal.entropy_calibration) and draws the 2-D density of
(page entropy, page varentropy) with the two threshold lines and the shaded region
where a page triggers re-selection (both above for rule "and", either for "or").

Usage: plot_entropy.py ENTROPY.h5 [--out entropy.png]
"""
import argparse
import sys

import h5py
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def attr(f, name):
    v = f.attrs[name]
    return v.decode() if isinstance(v, bytes) else v


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("calibration")
    ap.add_argument("--out", default="entropy.png")
    a = ap.parse_args()
    try:
        f = h5py.File(a.calibration, "r")
    except OSError as e:
        sys.exit(f"plot_entropy.py: cannot open {a.calibration}: {e}")
    with f:
        if attr(f, "format") != "kvcal.entropy_calibration":
            sys.exit(f"plot_entropy.py: {a.calibration} is not a kvcal.entropy_calibration file")
        hist = f["histogram"][:]
        ee, ve = f["entropy_edges"][:], f["varentropy_edges"][:]
        pe, pv = f["page_entropy"][:], f["page_varentropy"][:]
        te, tv = float(attr(f, "entropy_threshold")), float(attr(f, "varentropy_threshold"))
        rule, unit = attr(f, "rule"), attr(f, "unit")
        pct, rate = float(attr(f, "percentile")), float(attr(f, "trigger_rate"))
        page_size, kind = int(attr(f, "page_size")), attr(f, "page_varentropy")

    fig, ax = plt.subplots(figsize=(6.4, 5.0), dpi=120)
    density = np.ma.masked_equal(hist.T, 0)  # rows: varentropy bins, columns: entropy bins
    mesh = ax.pcolormesh(ee, ve, density, cmap="viridis", shading="flat")
    fig.colorbar(mesh, ax=ax, label="pages")
    ax.scatter(pe, pv, s=6, c="white", edgecolors="black", linewidths=0.3, alpha=0.6, label="pages")
    ax.axvline(te, color="crimson", lw=1.5, label=f"entropy p{pct:g} = {te:.3f}")
    ax.axhline(tv, color="darkorange", lw=1.5, label=f"varentropy p{pct:g} = {tv:.3f}")
    x_max, y_max = max(ee[-1], te) * 1.02, max(ve[-1], tv) * 1.02
    x_min, y_min = min(ee[0], te), min(ve[0], tv)
    if rule == "and":
        ax.fill_between([te, x_max], tv, y_max, color="crimson", alpha=0.15, label="re-select (and)")
    else:
        ax.fill_between([te, x_max], y_min, y_max, color="crimson", alpha=0.15, label="re-select (or)")
        ax.fill_between([x_min, te], tv, y_max, color="crimson", alpha=0.15)
    ax.set_xlim(x_min, x_max)
    ax.set_ylim(y_min, y_max)
    ax.set_xlabel(f"page entropy ({unit})")
    ax.set_ylabel(f"page varentropy ({unit}²; {kind})")
    ax.set_title(f"{len(pe)} pages of {page_size} tokens; {rate:.1%} trigger")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out)
    print(a.out)


if __name__ == "__main__":
    main()
