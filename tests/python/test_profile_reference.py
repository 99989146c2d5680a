#!/usr/bin/env python3
"""kvcal profile-heads against the NumPy reference (scripts/profile_heads_reference.py).

Synthetic dumps (scripts/make_synthetic_dump.py: float16 and float32, Hq > Hkv,
query or KV heads stored, several samples of odd sizes) are profiled by kvcal
and by the reference with the same options; stability, similarity and the
pairwise overlaps must agree to 1e-6, budget ratios to 1e-6, roles and pivots
exactly.

Usage: python3 tests/python/test_profile_reference.py [path/to/kvcal] [unittest options]
The binary may also come from $KVCAL_BIN; by default build/bin/kvcal or
build/release/bin/kvcal, whichever has profile-heads. Skips (with a message)
when numpy or h5py is missing or when no kvcal binary is found.
"""
import os
import subprocess
import sys
import tempfile
import unittest

try:
    import h5py
    import numpy as np
    MISSING = None
except ImportError as e:  # pragma: no cover
    MISSING = f"numpy and h5py are needed ({e}); install them with: python3 -m pip install numpy h5py"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")
REFERENCE = os.path.join(SCRIPTS, "profile_heads_reference.py")
GENERATOR = os.path.join(SCRIPTS, "make_synthetic_dump.py")
KVCAL = None  # set in main / find_kvcal
TOL = 1e-6

# name -> generator options. Small, odd sizes; float16 and float32; Hq > Hkv.
DUMPS = {
    "f16_g3": "--layers 3 --q-heads 6 --kv-heads 2 --samples 3 --prompt-len 37,50,29 --steps 9,4,12 "
              "--dtype float16 --seed 11",
    "f16_g3_kv": "--layers 3 --q-heads 6 --kv-heads 2 --samples 2 --prompt-len 41,23 --steps 6,11 "
                 "--dtype float16 --store kv --seed 12",
    "f32_g2": "--layers 2 --q-heads 8 --kv-heads 4 --samples 2 --prompt-len 61,44 --steps 7,10 "
              "--dtype float32 --seed 13",
    "f16_wide": "--layers 2 --q-heads 12 --kv-heads 4 --samples 2 --prompt-len 301,257 --steps 20,13 "
                "--dtype float16 --p-redundant 0.5 --seed 14",
    "f32_wide": "--layers 2 --q-heads 10 --kv-heads 5 --samples 2 --prompt-len 211,190 --steps 15,18 "
                "--dtype float32 --p-redundant 0.5 --seed 15",
    # nearly flat rows: many equal float16 values, so the top-k tie rule (lower position wins) decides
    "f16_ties": "--layers 2 --q-heads 4 --kv-heads 4 --samples 2 --prompt-len 97,130 --steps 9,14 "
                "--dtype float16 --scale 0.03 --store kv --seed 16",
    "f16_ties_q": "--layers 2 --q-heads 8 --kv-heads 4 --samples 2 --prompt-len 88,121 --steps 10,7 "
                  "--dtype float16 --scale 0.03 --seed 17",
}

# (dumps, options shared by both tools)
CASES = [
    (["f16_g3"], "--pool 5 --topk 8 --gqa mean --budget 0.95"),
    (["f16_g3"], "--pool 1 --topk 8 --gqa max --budget 0.95"),
    (["f32_g2"], "--pool 5 --topk-frac 0.2 --gqa mean --budget 0.9"),
    (["f32_g2"], "--pool 1 --topk-frac 0.1 --gqa max --budget 0.9 --tau-sim 0.4"),
    # two dumps at once, one storing KV heads; --topk 30 exceeds two prompt lengths (23, 29): k varies by step there
    (["f16_g3", "f16_g3_kv"], "--pool 3 --topk 30 --gqa mean --budget 0.95"),
    (["f16_wide"], "--pool 1 --topk 64 --gqa mean --tau-stable 0.6 --tau-sim 0.45 --budget 0.8"),
    (["f16_wide"], "--pool 5 --topk-frac 0.15 --gqa max --budget 0.8"),
    (["f16_wide"], "--pool 4 --topk 32 --gqa mean --budget 0.8 --order similar-first"),
    (["f32_wide"], "--pool 5 --topk 50 --gqa mean --tau-stable 0.55 --budget 0.8"),
    (["f32_wide"], "--pool 1 --topk-frac 0.3 --gqa max --tau-sim 0.6 --budget 0.8"),
    (["f16_ties"], "--pool 1 --topk 24 --budget 0.9"),
    (["f16_ties"], "--pool 1 --topk-frac 0.3 --budget 0.9"),
    (["f16_ties_q"], "--pool 1 --topk 20 --gqa max --budget 0.9"),
    # tiny top-k and tau_stable 0: compressed heads with stability 0 (the 1e-3 floor of the weights)
    (["f32_g2"], "--pool 1 --topk 1 --tau-stable 0 --tau-sim 1 --budget 0.5"),
]


def find_kvcal():
    if KVCAL:
        return KVCAL
    env = os.environ.get("KVCAL_BIN")
    if env:
        return env
    for rel in ("build/bin/kvcal", "build/release/bin/kvcal"):
        path = os.path.join(ROOT, rel)
        if os.access(path, os.X_OK):
            r = subprocess.run([path, "profile-heads", "--help"], capture_output=True)
            if r.returncode == 0:
                return path
    return None


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def read_heads(path):
    with h5py.File(path, "r") as f:
        return {k: f["heads"][k][()] for k in f["heads"]}


@unittest.skipIf(MISSING is not None, MISSING or "")
class ProfileReferenceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.kvcal = find_kvcal()
        if cls.kvcal is None:
            raise unittest.SkipTest("no kvcal binary with profile-heads: pass its path as the first argument or "
                                    "in KVCAL_BIN, or build it (ninja -C build)")
        if not os.access(cls.kvcal, os.X_OK):
            raise AssertionError(f"{cls.kvcal} is not an executable")
        cls.tmp = tempfile.TemporaryDirectory(prefix="kvcal_ref_")
        cls.dumps = {}
        for name, opts in DUMPS.items():
            path = os.path.join(cls.tmp.name, name + ".h5")
            r = run([sys.executable, GENERATOR, *opts.split(), "--out", path])
            assert r.returncode == 0, f"generator failed for {name}: {r.stderr}"
            cls.dumps[name] = path

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def profile_both(self, dumps, opts, tag):
        paths = [self.dumps[d] if d in self.dumps else d for d in dumps]
        k_out = os.path.join(self.tmp.name, tag + "_kvcal.h5")
        r_out = os.path.join(self.tmp.name, tag + "_ref.h5")
        k = run([self.kvcal, "-q", "profile-heads", *paths, *opts.split(), "--threads", "2", "--out", k_out])
        r = run([sys.executable, REFERENCE, *paths, *opts.split(), "--out", r_out])
        return k, r, k_out, r_out

    def compare(self, got, want, context):
        """got: kvcal, want: reference."""
        problems = []
        L, H = want["stability"].shape
        for key in ("stability", "similarity", "budget_ratio", "pairwise_overlap", "role", "pivot"):
            g, w = got[key], want[key]
            self.assertEqual(g.shape, w.shape, f"{context}: /heads/{key} shape")
            if key in ("role", "pivot"):
                bad = np.argwhere(g != w)
            else:
                bad = np.argwhere(~(np.abs(g.astype(np.float64) - w.astype(np.float64)) <= TOL))
            for idx in bad[:8]:
                problems.append(f"/heads/{key}{list(idx)}: reference {w[tuple(idx)]!r}, kvcal {g[tuple(idx)]!r}")
            if len(bad) > 8:
                problems.append(f"/heads/{key}: {len(bad) - 8} more")
        self.assertFalse(problems, f"{context}: kvcal disagrees with the reference:\n  " + "\n  ".join(problems))
        # the comparison must not be vacuous
        st = want["stability"]
        self.assertGreater(float(st.max() - st.min()), 0.05, f"{context}: stability has no spread")
        self.assertLess(float(want["pairwise_overlap"].min()), 0.999, f"{context}: every overlap is 1")
        return want["role"]

    def test_agreement(self):
        roles_seen = set()
        for i, (dumps, opts) in enumerate(CASES):
            context = f"case {i}: {' + '.join(dumps)} {opts}"
            with self.subTest(case=context):
                k, r, k_out, r_out = self.profile_both(dumps, opts, f"case{i}")
                self.assertEqual(r.returncode, 0, f"{context}: reference failed: {r.stderr}")
                self.assertEqual(k.returncode, 0, f"{context}: kvcal failed: {k.stderr}")
                role = self.compare(read_heads(k_out), read_heads(r_out), context)
                roles_seen |= set(int(x) for x in np.unique(role))
                print(f"  ok  {context}: roles {np.bincount(role.ravel(), minlength=5)[1:].tolist()}",
                      file=sys.stderr)
        self.assertEqual(roles_seen, {1, 2, 3, 4}, "the cases should produce every role")

    def test_real_smollm2_dump(self):
        """The real SmolLM2-135M dump shipped in data/ (float16, 9 query heads in 3 KV groups)."""
        real = os.path.join(ROOT, "data", "smollm2_attention.h5")
        for i, opts in enumerate(["--topk-frac 0.1 --pool 5", "--topk 16 --pool 1 --gqa max --budget 0.6",
                                  "--topk-frac 0.2 --pool 3 --tau-sim 0.7 --order similar-first"]):
            with self.subTest(opts=opts):
                k, r, k_out, r_out = self.profile_both([real], opts, f"real{i}")
                self.assertEqual(r.returncode, 0, f"reference failed: {r.stderr}")
                self.assertEqual(k.returncode, 0, f"kvcal failed: {k.stderr}")
                self.compare(read_heads(k_out), read_heads(r_out), f"data/smollm2_attention.h5 {opts}")

    def test_infeasible_budget_fails_in_both(self):
        # Most heads of f16_g3 are full (pivot/volatile) at tau_stable 0.99: budget 0.05 cannot be met.
        k, r, _, _ = self.profile_both(["f16_g3"], "--pool 5 --topk 8 --tau-stable 0.99 --budget 0.05", "budget")
        self.assertNotEqual(r.returncode, 0, "reference accepted an infeasible budget")
        self.assertNotEqual(k.returncode, 0, "kvcal accepted an infeasible budget")
        self.assertIn("budget", k.stderr)

    def test_utf8_string_attributes(self):
        """Dumps written by scripts/record_attention.py (and h5py by default) store
        the root string attributes as variable-length UTF-8 strings."""
        path = os.path.join(self.tmp.name, "vlen.h5")
        r = run([sys.executable, GENERATOR, *DUMPS["f32_g2"].split(), "--string-attrs", "vlen", "--out", path])
        self.assertEqual(r.returncode, 0, r.stderr)
        k, r, k_out, r_out = self.profile_both([path], "--pool 5 --topk-frac 0.2 --budget 0.9", "vlen")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(k.returncode, 0, f"kvcal cannot read a dump with UTF-8 string attributes: {k.stderr}")
        self.compare(read_heads(k_out), read_heads(r_out), "vlen string attributes")


def main():
    global KVCAL
    argv = [sys.argv[0]]
    for a in sys.argv[1:]:
        if KVCAL is None and not a.startswith("-") and (os.path.sep in a or os.path.isfile(a)):
            KVCAL = os.path.abspath(a)
        else:
            argv.append(a)
    if MISSING:
        print(f"skipping: {MISSING}", file=sys.stderr)
    unittest.main(argv=argv, verbosity=2)


if __name__ == "__main__":
    main()
