#!/usr/bin/env python3
"""kvcal eval-fidelity against an independent NumPy replay of KCVT on the real long sample.

For the quantization-only methods (kcvt2, kcvt3, kcvt4) the whole pipeline is re-derived here
from the stored queries, keys and values of data/smollm2_long.h5: streaming 96-token blocks
(the prompt's full blocks compressed at once, the next one when decode fills it), keys
quantized per channel and values per token with a binary16 minimum and the step rounded up
to binary16, attention in float64 over the dequantized cache, and the exact byte count. The
CSV kvcal writes must agree (errors to 1e-3 relative, sizes exactly). Also checks that
scripts/plot_fidelity.py draws the CSV and refuses a file that is not one.

Usage: python3 tests/python/test_fidelity_reference.py [path/to/kvcal]   (or KVCAL_BIN=...)
Skips with a message when numpy, h5py or matplotlib is missing.
"""
import csv
import math
import os
import subprocess
import sys
import tempfile
import unittest

try:
    import h5py
    import numpy as np
    import matplotlib  # noqa: F401
    MISSING = None
except ImportError as e:  # pragma: no cover
    MISSING = f"numpy, h5py and matplotlib are needed ({e}); python3 -m pip install numpy h5py matplotlib"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = os.path.join(ROOT, "data", "smollm2_long.h5")
KVCAL = os.environ.get("KVCAL_BIN")
BLOCK = 96


def half_up(x):
    """The smallest binary16 value >= x (x >= 0, float32)."""
    h = np.float16(x)
    if np.float32(h) < x:
        h = np.nextafter(h, np.float16(np.inf))
    return h


def params(group, bits):
    """(min, delta) of one group as kvcal stores them (binary16)."""
    top = (1 << bits) - 1
    lo, hi = group.min(), group.max()
    rng = np.float32(np.float32(hi) - np.float32(lo))
    if rng == 0:
        return np.float16(lo), np.float16(0)
    delta = half_up(np.float32(rng / np.float32(top)))
    while float(lo) + top * float(delta) < float(hi):
        delta = np.nextafter(delta, np.float16(np.inf))
    return np.float16(lo), delta


def dequantize(x, mn, delta, bits):
    """Codes and reconstruction of float16 values x with (min, delta) broadcastable to x."""
    top = np.float32((1 << bits) - 1)
    mn32, d32 = mn.astype(np.float32), delta.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = (x.astype(np.float32) - mn32) / d32
    q = np.where(d32 > 0, np.clip(q, 0, top), 0).astype(np.float32)
    code = np.floor(q + np.float32(0.5))
    return mn32 + code * d32


def compress_block(k, v, bits):
    """k, v float16 [96, Dh] -> dequantized float32 blocks."""
    kp = [params(k[:, c], bits) for c in range(k.shape[1])]
    kmin = np.array([p[0] for p in kp], dtype=np.float16)[None, :]
    kdel = np.array([p[1] for p in kp], dtype=np.float16)[None, :]
    vp = [params(v[t, :], bits) for t in range(v.shape[0])]
    vmin = np.array([p[0] for p in vp], dtype=np.float16)[:, None]
    vdel = np.array([p[1] for p in vp], dtype=np.float16)[:, None]
    return dequantize(k, kmin, kdel, bits), dequantize(v, vmin, vdel, bits)


def attend(q, k, v, scale):
    s = (k.astype(np.float64) @ q.astype(np.float64)) * scale
    p = np.exp(s - s.max())
    p /= p.sum()
    return p @ v.astype(np.float64)


def replay(path, bits):
    """rel errors, cosines and the KV size in % for one kcvt method."""
    rel, cos = [], []
    stored = fp16 = 0
    with h5py.File(path, "r") as f:
        hq, hkv = int(f.attrs["num_q_heads"]), int(f.attrs["num_kv_heads"])
        for g in f["samples"].values():
            n = int(g.attrs["prompt_len"])
            qs, ks, vs = g["queries"][()], g["keys"][()], g["values"][()]
            steps, layers, dh = qs.shape[0], qs.shape[1], qs.shape[3]
            scale = 1.0 / math.sqrt(dh)
            group = hq // hkv
            row_bytes = (dh * bits + 7) // 8
            for layer in range(layers):
                for h in range(hkv):
                    k, v = ks[layer, h], vs[layer, h]
                    kc, vc = k.astype(np.float32).copy(), v.astype(np.float32).copy()
                    done = 0
                    for t in range(steps):
                        total = n + t + 1
                        # Every full block is compressed (KCVT blocks depend only on their
                        # tokens, so when does not matter: the prompt's at once, then one per 96 steps).
                        while total - done >= BLOCK:
                            kc[done:done + BLOCK], vc[done:done + BLOCK] = compress_block(
                                k[done:done + BLOCK], v[done:done + BLOCK], bits)
                            done += BLOCK
                        for j in range(group):
                            qv = qs[t, layer, h * group + j].astype(np.float64)
                            o = attend(qv, k[:total], v[:total], scale)
                            oh = attend(qv, kc[:total], vc[:total], scale)
                            rel.append(np.linalg.norm(o - oh) / np.linalg.norm(o))
                            cos.append(float(o @ oh) / (np.linalg.norm(o) * np.linalg.norm(oh)))
                    blocks = done // BLOCK
                    end = n + steps
                    stored += blocks * (2 * BLOCK * row_bytes + dh * 4 + BLOCK * 4) + (end - done) * dh * 4
                    fp16 += end * dh * 4
    return np.array(rel), np.array(cos), 100.0 * stored / fp16


@unittest.skipIf(MISSING is not None, MISSING or "")
class FidelityReference(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.csv = os.path.join(cls.tmp.name, "r.csv")
        r = subprocess.run([KVCAL, "-q", "eval-fidelity", "--dump", LONG, "--methods", "fp16,kcvt2,kcvt3,kcvt4",
                            "--out", cls.csv], capture_output=True, text=True)
        if r.returncode != 0:
            raise AssertionError(r.stderr)
        with open(cls.csv, newline="") as f:
            cls.rows = {row["method"]: row for row in csv.DictReader(f)}

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_fp16_is_exact(self):
        row = self.rows["fp16"]
        self.assertEqual(float(row["kv_size_pct"]), 100.0)
        self.assertEqual(float(row["rel_err_mean"]), 0.0)
        self.assertEqual(float(row["cos_mean"]), 1.0)

    def test_kcvt_matches_numpy_replay(self):
        for bits in (2, 3, 4):
            with self.subTest(bits=bits):
                rel, cos, size = replay(LONG, bits)
                row = self.rows[f"kcvt{bits}"]
                self.assertAlmostEqual(float(row["kv_size_pct"]), size, places=3)
                self.assertLess(abs(float(row["rel_err_mean"]) - rel.mean()), 1e-3 * rel.mean())
                self.assertLess(abs(float(row["rel_err_p99"]) - np.percentile(rel, 99)), 2e-3 * np.percentile(rel, 99))
                self.assertLess(abs(float(row["cos_mean"]) - cos.mean()), 1e-5)

    def test_plot_fidelity(self):
        png = os.path.join(self.tmp.name, "f.png")
        script = os.path.join(ROOT, "scripts", "plot_fidelity.py")
        r = subprocess.run([sys.executable, script, self.csv, "--out", png], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        bad = os.path.join(self.tmp.name, "bad.csv")
        with open(bad, "w") as f:
            f.write("a,b\n1,2\n")
        r = subprocess.run([sys.executable, script, bad, "--out", png], capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("not an eval-fidelity CSV", r.stderr)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        KVCAL = sys.argv.pop(1)
    if MISSING is None and not KVCAL:
        sys.exit("give the kvcal binary as the first argument or in KVCAL_BIN")
    unittest.main()
