#!/usr/bin/env python3
"""Attention error against KV size, from one or more `kvcal eval-fidelity --out` CSVs.

Each method is a point (relative error mean, with its p99 as an error bar up) at
its KV size in % of fp16; methods of one family (kcvt, h2o, expander, hex) at
2/3/4 bits are joined by a line, so the HEX ablation reads at a glance. Several
CSVs (e.g. append and full mode) are drawn with different markers.

Usage: plot_fidelity.py REPORT.csv [MORE.csv ...] [--out fidelity.png] [--log]
"""
import argparse
import csv
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLUMNS = ["method", "kv_size_pct", "rel_err_mean", "rel_err_p99", "cos_mean"]


def read_report(path):
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        sys.exit(f"plot_fidelity.py: cannot read {path}: {e}")
    if not rows or any(c not in rows[0] for c in COLUMNS):
        sys.exit(f"plot_fidelity.py: {path} is not an eval-fidelity CSV (columns {','.join(COLUMNS)})")
    out = []
    for r in rows:
        try:
            out.append((r["method"], float(r["kv_size_pct"]), float(r["rel_err_mean"]), float(r["rel_err_p99"])))
        except ValueError:
            sys.exit(f"plot_fidelity.py: {path}: bad number in row {r}")
    return out


def family(method):
    m = re.fullmatch(r"(kcvt|h2o|expander|hex)([234])(@\w+)?", method)
    return (m.group(1) + (m.group(3) or ""), int(m.group(2))) if m else (method, 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--out", default="fidelity.png")
    ap.add_argument("--log", action="store_true", help="logarithmic error axis")
    a = ap.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = "osD^v"
    colors = {}
    for i, path in enumerate(a.reports):
        rows = read_report(path)
        groups = {}
        for method, size, err, p99 in rows:
            fam, bits = family(method)
            groups.setdefault(fam, []).append((bits, size, err, p99, method))
        for fam, pts in groups.items():
            pts.sort()
            if fam not in colors:
                colors[fam] = f"C{len(colors) % 10}"
            xs = [p[1] for p in pts]
            ys = [p[2] for p in pts]
            up = [max(p[3] - p[2], 0) for p in pts]
            label = fam if len(a.reports) == 1 else f"{fam} ({path})"
            ax.errorbar(xs, ys, yerr=[[0] * len(pts), up], fmt=markers[i % len(markers)] + "-", color=colors[fam],
                        capsize=3, label=label)
            for p in pts:
                ax.annotate(p[4], (p[1], p[2]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("KV size (% of fp16)")
    ax.set_ylabel("attention output relative error (mean; bar: p99)")
    if a.log:
        ax.set_yscale("symlog", linthresh=1e-3)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("kvcal eval-fidelity")
    fig.tight_layout()
    try:
        fig.savefig(a.out, dpi=120)
    except OSError as e:
        sys.exit(f"plot_fidelity.py: cannot write {a.out}: {e}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
