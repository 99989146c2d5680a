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
    a["seal"]                                    # sealed bundles: the verified seal, else None

Bundles of format_version 2 carry an integrity seal in their first 512 bytes
(the HDF5 user block, which h5py skips): the SHA-256 of the rest of the file.
load() checks it with hashlib before h5py opens the file and raises
ValueError when it does not match; check_seal(path) does only that.

Works on every kvcal format: kvcal.masks, kvcal.head_profile,
kvcal.entropy_calibration, kvcal.bundle and kvcal.attention_dump (whose samples
are read whole: meant for small dumps).

Usage as a script: kvcal_artifacts.py FILE  (prints a short summary)
"""
import hashlib
import json
import os
import sys

import h5py
import numpy as np

FORMATS = ("kvcal.masks", "kvcal.head_profile", "kvcal.entropy_calibration", "kvcal.bundle", "kvcal.attention_dump")


SEAL_SIZE = 512
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _seal_text(covered, digest):
    return (f"kvcal-seal 1\nalgorithm sha256\noffset {SEAL_SIZE}\nlength {covered}\nsha256 {digest}\n").encode()


def _sha256_from(path, offset):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_seal(path):
    """Verifies a bundle's integrity seal with hashlib. Returns None for a file
    without one (the HDF5 signature at byte 0), else {"sha256", "covered"};
    raises ValueError when the seal is damaged or does not match the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(SEAL_SIZE)
    if head.startswith(HDF5_SIGNATURE):
        return None
    if not head.startswith(b"kvcal-seal 1\n"):
        raise ValueError(f"{path}: neither an integrity seal nor the HDF5 signature at its start")
    if size <= SEAL_SIZE:
        raise ValueError(f"{path}: truncated: {size} bytes")
    lines = head.rstrip(b"\0").decode("ascii", "replace").split("\n")
    fields = dict(line.split(" ", 1) for line in lines[1:] if " " in line)
    try:
        covered, digest = int(fields["length"]), fields["sha256"]
    except (KeyError, ValueError):
        raise ValueError(f"{path}: the integrity seal is damaged") from None
    if head != _seal_text(covered, digest).ljust(SEAL_SIZE, b"\0"):
        raise ValueError(f"{path}: the integrity seal is damaged")
    if size != SEAL_SIZE + covered:
        raise ValueError(f"{path}: {size} bytes, but its integrity seal covers {SEAL_SIZE + covered}")
    actual = _sha256_from(path, SEAL_SIZE)
    if actual != digest:
        raise ValueError(f"{path}: checksum mismatch: SHA-256 {actual[:16]}, the seal records {digest[:16]}")
    return {"sha256": digest, "covered": covered}


def reseal(path):
    """Writes the seal of a sealed bundle again, for its current bytes (after
    an edit with h5py, which leaves the old seal in place). Not a signature:
    anyone can seal a file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(SEAL_SIZE)
    if head.startswith(HDF5_SIGNATURE) or size <= SEAL_SIZE:
        raise ValueError(f"{path}: has no {SEAL_SIZE}-byte user block to hold a seal")
    text = _seal_text(size - SEAL_SIZE, _sha256_from(path, SEAL_SIZE))
    with open(path, "r+b") as f:
        f.write(text.ljust(SEAL_SIZE, b"\0"))


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
    seal = check_seal(path)  # before h5py (libhdf5) reads a byte
    with h5py.File(path, "r") as f:
        attrs = _attrs(f)
        fmt = attrs.get("format")
        if fmt not in FORMATS:
            raise ValueError(f"{path}: not a kvcal artifact (format {fmt!r})")
        out = {"format": fmt, "format_version": attrs.get("format_version"), "attrs": attrs, "seal": seal}
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
    seal = f", seal verified (SHA-256 {a['seal']['sha256'][:16]}...)" if a["seal"] else ""
    print(f"{sys.argv[1]}: {a['format']} v{a['format_version']}{seal}")
    for mid, m in a.get("masks", {}).items():
        print(f"  mask {mid}: {m['attrs']['rows']}x{m['attrs']['cols']}, nnz {len(m['indices'])}")
    if "heads" in a:
        print(f"  heads: roles {np.bincount(a['heads']['role'].ravel(), minlength=5)[1:].tolist()} "
              f"(anchor, volatile, pivot, satellite)")
    if "entropy" in a:
        print(f"  entropy: thresholds {a['entropy']['entropy_threshold']:.4f}, {a['entropy']['varentropy_threshold']:.4f}")


if __name__ == "__main__":
    main()
