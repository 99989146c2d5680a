#!/usr/bin/env python3
"""Read kvcal artifacts with h5py and NumPy alone (no kvcal needed).

    import kvcal_artifacts
    a = kvcal_artifacts.load("smollm2.kvcal.h5")
    a["format"], a["attrs"]                      # root attributes
    a["masks"]["mask_0000"]["indptr"], ...      # CSR arrays and each mask's attributes
    a["masks"]["mask_0000"]["dense"]()           # the 0/1 mask as a NumPy array
    a["heads"]["role"], a["heads"]["attrs"]      # head profile ([L, Hkv] arrays)
    a["entropy"]["entropy_threshold"]            # entropy calibration
    a["manifest"]                                # bundles: the parsed manifest

Works on every kvcal format: kvcal.masks, kvcal.head_profile,
kvcal.entropy_calibration, kvcal.bundle and kvcal.attention_dump (whose samples
are read whole: meant for small dumps).

Usage as a script: kvcal_artifacts.py FILE  (prints a short summary)
"""
import json
import sys

import h5py
import numpy as np

FORMATS = ("kvcal.masks", "kvcal.head_profile", "kvcal.entropy_calibration", "kvcal.bundle", "kvcal.attention_dump")


def _value(v):
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if isinstance(v, np.generic):
        return v.item()
    return v


def _attrs(obj):
    return {k: _value(v) for k, v in obj.attrs.items()}


def _masks(group):
    out = {}
    for mid, g in group.items():
        m = {"indptr": g["indptr"][()], "indices": g["indices"][()], "attrs": _attrs(g)}
        rows, cols = int(m["attrs"]["rows"]), int(m["attrs"]["cols"])

        def dense(m=m, rows=rows, cols=cols):
            d = np.zeros((rows, cols), dtype=np.uint8)
            for r in range(rows):
                d[r, m["indices"][m["indptr"][r]:m["indptr"][r + 1]]] = 1
            return d

        m["dense"] = dense
        out[mid] = m
    return out


def _datasets(group):
    return {k: v[()] for k, v in group.items() if isinstance(v, h5py.Dataset)}


def load(path):
    """Returns a dict of NumPy arrays and attributes for any kvcal artifact."""
    with h5py.File(path, "r") as f:
        attrs = _attrs(f)
        fmt = attrs.get("format")
        if fmt not in FORMATS:
            raise ValueError(f"{path}: not a kvcal artifact (format {fmt!r})")
        out = {"format": fmt, "format_version": attrs.get("format_version"), "attrs": attrs}
        if fmt in ("kvcal.masks", "kvcal.bundle"):
            out["masks"] = _masks(f["masks"])
        if fmt == "kvcal.head_profile":
            out["heads"] = dict(_datasets(f["heads"]), attrs=attrs)
        if fmt == "kvcal.entropy_calibration":
            out["entropy"] = dict(_datasets(f), **attrs)
        if fmt == "kvcal.bundle":
            out["heads"] = dict(_datasets(f["heads"]), attrs=_attrs(f["heads"]))
            out["entropy"] = dict(_datasets(f["entropy"]), **_attrs(f["entropy"]))
            out["manifest"] = json.loads(attrs["manifest"])
        if fmt == "kvcal.attention_dump":
            out["samples"] = {name: dict(_datasets(g), attrs=_attrs(g)) for name, g in f["samples"].items()}
        return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    a = load(sys.argv[1])
    print(f"{sys.argv[1]}: {a['format']} v{a['format_version']}")
    for mid, m in a.get("masks", {}).items():
        print(f"  mask {mid}: {m['attrs']['rows']}x{m['attrs']['cols']}, nnz {len(m['indices'])}")
    if "heads" in a:
        print(f"  heads: roles {np.bincount(a['heads']['role'].ravel(), minlength=5)[1:].tolist()} "
              f"(anchor, volatile, pivot, satellite)")
    if "entropy" in a:
        print(f"  entropy: thresholds {a['entropy']['entropy_threshold']:.4f}, {a['entropy']['varentropy_threshold']:.4f}")


if __name__ == "__main__":
    main()
