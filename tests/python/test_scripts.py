#!/usr/bin/env python3
"""End to end on the real SmolLM2 dump in data/: kvcal calibrate-entropy against an
independent NumPy computation of the same pages and percentiles, and the plotting
scripts (scripts/plot_heads.py, scripts/plot_entropy.py) producing their PNGs.

Usage: python3 tests/python/test_scripts.py [path/to/kvcal]   (or KVCAL_BIN=...)
Skips with a message when numpy, h5py or matplotlib is missing.
"""
import json
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
REAL = os.path.join(ROOT, "data", "smollm2_attention.h5")
KVCAL = os.environ.get("KVCAL_BIN")


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def attr(f, name):
    v = f.attrs[name]
    return v.decode() if isinstance(v, bytes) else v


@unittest.skipIf(MISSING is not None, MISSING or "")
class RealDataScripts(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not KVCAL or not os.access(KVCAL, os.X_OK):
            raise unittest.SkipTest("no kvcal binary: pass its path as the first argument or in KVCAL_BIN")
        cls.tmp = tempfile.TemporaryDirectory(prefix="kvcal_scripts_")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def numpy_pages(self, page_size, kind, keep_partial):
        """Page statistics straight from the dump's token statistics, with NumPy."""
        pe, pv = [], []
        with h5py.File(REAL, "r") as f:
            for name in sorted(f["samples"]):
                g = f["samples"][name]
                h = g["token_entropy"][()].astype(np.float64)
                v = g["token_varentropy"][()].astype(np.float64)
                self.assertEqual(len(h), int(g.attrs["prompt_len"]) + g["decode"].shape[0])
                for s in range(0, len(h), page_size):
                    e = min(len(h), s + page_size)
                    if e - s < page_size and not keep_partial:
                        break
                    pe.append(h[s:e].mean())
                    pv.append(v[s:e].mean() if kind == "mean" else h[s:e].var())
        return np.array(pe), np.array(pv)

    def test_calibrate_entropy_matches_numpy(self):
        for page_size, kind, partial, pct, rule in [(16, "mean", "drop", 99, "and"), (8, "temporal", "keep", 90, "or"),
                                                    (32, "mean", "keep", 75, "and")]:
            with self.subTest(page_size=page_size, kind=kind, partial=partial):
                out = self.path(f"e{page_size}.h5")
                r = run([KVCAL, "-q", "calibrate-entropy", REAL, "--page-size", str(page_size), "--page-varentropy",
                         kind, "--partial-pages", partial, "--percentile", str(pct), "--rule", rule, "--out", out])
                self.assertEqual(r.returncode, 0, r.stderr)
                pe, pv = self.numpy_pages(page_size, kind, partial == "keep")
                te, tv = np.percentile(pe, pct), np.percentile(pv, pct)
                with h5py.File(out, "r") as f:
                    self.assertEqual(attr(f, "format"), "kvcal.entropy_calibration")
                    self.assertEqual(int(attr(f, "num_pages")), len(pe))
                    np.testing.assert_allclose(f["page_entropy"][()], pe, rtol=1e-12)
                    np.testing.assert_allclose(f["page_varentropy"][()], pv, rtol=1e-12, atol=1e-15)
                    self.assertAlmostEqual(float(attr(f, "entropy_threshold")), te, places=10)
                    self.assertAlmostEqual(float(attr(f, "varentropy_threshold")), tv, places=10)
                    fired = (pe > te) & (pv > tv) if rule == "and" else (pe > te) | (pv > tv)
                    self.assertAlmostEqual(float(attr(f, "trigger_rate")), fired.mean(), places=12)
                    self.assertEqual(int(f["histogram"][()].sum()), len(pe))
                png = self.path(f"e{page_size}.png")
                r = run([sys.executable, os.path.join(ROOT, "scripts", "plot_entropy.py"), out, "--out", png])
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assert_png(png)

    def test_plot_heads(self):
        heads = self.path("heads.h5")
        r = run([KVCAL, "-q", "profile-heads", REAL, "--topk-frac", "0.1", "--out", heads])
        self.assertEqual(r.returncode, 0, r.stderr)
        plots = self.path("plots")
        r = run([sys.executable, os.path.join(ROOT, "scripts", "plot_heads.py"), heads, "--out-dir", plots])
        self.assertEqual(r.returncode, 0, r.stderr)
        names = sorted(os.listdir(plots))
        self.assertEqual(names, ["role_counts.png", "role_map.png", "similarity_sorted.png", "stability_sorted.png"])
        for n in names:
            self.assert_png(os.path.join(plots, n))

    def assert_png(self, path):
        with open(path, "rb") as f:
            head = f.read(8)
        self.assertEqual(head, b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG")
        self.assertGreater(os.path.getsize(path), 5000, f"{path} is suspiciously small")


class BenchDecodeArguments(unittest.TestCase):
    """scripts/bench_decode.py refuses a malformed --env with one line and exit 2, before any run."""

    def bench(self, *args):
        return run([sys.executable, os.path.join(ROOT, "scripts", "bench_decode.py"), *args])

    def test_malformed_env(self):
        cases = {
            "AVX2": "expected LABEL:VAR=VALUE",
            ":KVCAL_BENCH_TARGET=AVX2": "expected LABEL:VAR=VALUE",
            "AVX2:": "expected LABEL:VAR=VALUE",
            "AVX2:KVCAL_BENCH_TARGET": "'KVCAL_BENCH_TARGET' is not VAR=VALUE",
            "AVX2:1X=2": "'1X=2' is not VAR=VALUE",
            "AVX2:A=1,A=2": "A given twice",
        }
        for spec, message in cases.items():
            with self.subTest(spec=spec):
                r = self.bench("--build", "/nonexistent", "--env", spec)
                self.assertEqual(r.returncode, 2, r.stderr)
                lines = r.stderr.strip().splitlines()
                self.assertEqual(len(lines), 1, r.stderr)
                self.assertIn(message, lines[0])
                self.assertEqual(r.stdout, "")

    def test_env_label_twice(self):
        # Labels are checked after the binaries: an empty build tree with a
        # bench_runtime that is executable but never run (no round starts).
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "bin"))
            exe = os.path.join(d, "bin", "bench_runtime")
            with open(exe, "w") as f:
                f.write("#!/bin/sh\nexit 1\n")
            os.chmod(exe, 0o755)
            r = self.bench("--build", d, "--env", "X:A=1", "--env", "X:A=2")
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("two runs labelled X", r.stderr)
            self.assertNotIn("round 1", r.stderr)
            r = self.bench("--build", d, "--env", f"{d}:A=1")
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(f"two runs labelled {d}", r.stderr)

    def fake_build(self, root, name, target, ms, far=None, near=None):
        """A build tree whose bench_runtime prints one benchmark's JSON, as Google Benchmark does
        (far, near: its prefetch_far and prefetch_near context lines; None: a binary without one)."""
        d = os.path.join(root, name)
        os.makedirs(os.path.join(d, "bin"))
        exe = os.path.join(d, "bin", "bench_runtime")
        context = {"simd_target": target}
        if far is not None:
            context["prefetch_far"] = far
        if near is not None:
            context["prefetch_near"] = near
        doc = {"context": context,
               "benchmarks": [{"run_name": "decode/hex4@int8/1/real_time", "run_type": "iteration",
                               "real_time": ms, "time_unit": "ms", "bytes_per_second": 1e9, "kv_size_pct": 31.5}]}
        with open(exe, "w") as f:
            f.write("#!/bin/sh\ncat <<'EOF'\n" + json.dumps(doc) + "\nEOF\n")
        os.chmod(exe, 0o755)
        return d

    def test_reports_each_runs_kernels(self):
        # Two builds on different SIMD targets: each run's kernels printed and
        # in the JSON report, and a warning that the runs differ; two on the
        # same target, no warning.
        with tempfile.TemporaryDirectory() as root:
            a = self.fake_build(root, "a", "AVX3_DL", 2.0, far="8192 B (3-bit), 16384 B (4-bit)",
                                near="96 rows (keys), 64 rows (values)")
            b = self.fake_build(root, "b", "AVX3+AVX512-VNNI", 2.5)
            c = self.fake_build(root, "c", "AVX3_DL", 2.2)
            out = os.path.join(root, "report.json")
            r = self.bench("--build", a, "--build", b, "--filter", "^decode/hex4@int8/1/", "--rounds", "1",
                           "--reps", "1", "--json", out)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn(f"{a} (kernels: AVX3_DL; far requests: 8192 B (3-bit), 16384 B (4-bit); "
                          "near requests: 96 rows (keys), 64 rows (values))", r.stdout)
            self.assertIn(f"{b} (kernels: AVX3+AVX512-VNNI):", r.stdout)  # no distance reported
            self.assertIn("the runs used different SIMD targets", r.stderr)
            self.assertIn("decode/hex4@int8/1           0.80", r.stdout)  # 2.0 / 2.5 ms
            with open(out) as f:
                report = json.load(f)
            self.assertEqual(report["simd_targets"], {a: "AVX3_DL", b: "AVX3+AVX512-VNNI"})
            self.assertEqual(report["prefetch_far"], {a: "8192 B (3-bit), 16384 B (4-bit)", b: None})
            self.assertEqual(report["prefetch_near"], {a: "96 rows (keys), 64 rows (values)", b: None})
            r = self.bench("--build", a, "--build", c, "--filter", "^decode/hex4@int8/1/", "--rounds", "1",
                           "--reps", "1")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertNotIn("different SIMD targets", r.stderr)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:]]
    if args and not args[0].startswith("-"):
        KVCAL = os.path.abspath(args.pop(0))
    if MISSING:
        print(f"skipping: {MISSING}", file=sys.stderr)
    unittest.main(argv=[sys.argv[0]] + args, verbosity=2)
