#!/usr/bin/env python3
"""Tests for the kvcal.attention_dump files written by scripts/record_attention.py.

(a) The shipped data/smollm2_attention.h5: root attributes, shapes, dtypes, row sums, zero
    padding, token stats. Runs whenever h5py and numpy can be imported.
(b) A fresh recording of one tiny prompt (T = 2) with the real model, checked the same way.
    Runs only when torch and transformers are importable and KVCAL_SMOLLM2_GGUF names the
    SmolLM2-135M-Instruct .gguf file; skipped otherwise.

Run: python3 tests/python/test_record_attention.py   (exit 0 on pass or skip)
"""
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import unittest

try:
    import h5py
    import numpy as np
except ImportError:  # every test skips without them
    h5py = np = None

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DUMP = os.path.join(ROOT, "data", "smollm2_attention.h5")
PROMPTS = os.path.join(ROOT, "data", "prompts.txt")
SCRIPT = os.path.join(ROOT, "scripts", "record_attention.py")

STRING_ATTRS = ("format", "model", "kvcal_recorder_version", "command_line", "created_utc",
                "prompts_sha256")
INT_ATTRS = ("format_version", "num_layers", "num_q_heads", "num_kv_heads")


def as_str(v):
    return v.decode("utf-8") if isinstance(v, bytes) else v


class DumpChecks:
    """Invariant checks shared by (a) and (b); mixed into a TestCase."""

    def check_dump(self, path, expect_samples=None, expect_T=None, expect_prompts_sha=None):
        with h5py.File(path, "r") as f:
            a = f.attrs
            for k in STRING_ATTRS:
                self.assertIn(k, a, f"root attribute {k} missing")
                self.assertIsInstance(as_str(a[k]), str, f"root attribute {k} is not a string")
                # kvcal's C++ reader (HDF5 1.10) cannot read variable-length UTF-8 strings
                self.assertFalse(a.get_id(k).get_type().is_variable_str(),
                                 f"root attribute {k} is a variable-length string")
            for k in INT_ATTRS:
                self.assertIn(k, a, f"root attribute {k} missing")
                self.assertEqual(np.asarray(a[k]).dtype, np.int64, f"root attribute {k} not int64")
            self.assertEqual(as_str(a["format"]), "kvcal.attention_dump")
            self.assertEqual(int(a["format_version"]), 1)
            self.assertEqual(as_str(a["kvcal_recorder_version"]), "1")
            self.assertRegex(as_str(a["created_utc"]), r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
            self.assertRegex(as_str(a["prompts_sha256"]), r"^[0-9a-f]{64}$")
            self.assertTrue(as_str(a["model"]).strip())
            if expect_prompts_sha is not None:
                self.assertEqual(as_str(a["prompts_sha256"]), expect_prompts_sha)
            L, Hq, Hkv = (int(a[k]) for k in ("num_layers", "num_q_heads", "num_kv_heads"))
            self.assertGreater(L, 0)
            self.assertGreater(Hkv, 0)
            self.assertEqual(Hq % Hkv, 0, "num_q_heads must be a multiple of num_kv_heads")

            names = sorted(f["samples"].keys())
            self.assertTrue(names, "no samples")
            self.assertEqual(names, [f"sample_{i:03d}" for i in range(len(names))])
            if expect_samples is not None:
                self.assertEqual(len(names), expect_samples)
            for name in names:
                with self.subTest(sample=name):
                    self.check_sample(f["samples"][name], L, Hq, Hkv, expect_T)

    def check_sample(self, g, L, Hq, Hkv, expect_T):
        for k in ("prompt_len", "num_decode_steps"):
            self.assertEqual(np.asarray(g.attrs[k]).dtype, np.int64, f"{k} not int64")
        N, T = int(g.attrs["prompt_len"]), int(g.attrs["num_decode_steps"])
        self.assertGreater(N, 0)
        self.assertGreater(T, 0)
        if expect_T is not None:
            self.assertEqual(T, expect_T)

        pre, dec = g["prefill"], g["decode"]
        self.assertEqual(pre.shape, (L, Hq, N))
        self.assertEqual(dec.shape, (T, L, Hq, N + T))
        self.assertIn(pre.dtype, (np.float16, np.float32))
        self.assertEqual(dec.dtype, pre.dtype)
        tol = 1e-3 if pre.dtype == np.float16 else 1e-5
        for d in (pre, dec):
            self.assertIsNotNone(d.chunks, f"{d.name} is not chunked")
            self.assertEqual(d.compression, "gzip", f"{d.name} is not gzip-compressed")
            self.assertTrue(d.shuffle, f"{d.name} has no shuffle filter")

        p = pre[()].astype(np.float64)
        self.assertTrue(np.isfinite(p).all())
        self.assertGreaterEqual(p.min(), 0.0)
        self.assertLessEqual(np.abs(p.sum(axis=-1) - 1.0).max(), tol, "prefill row sums")

        x = dec[()].astype(np.float64)
        self.assertTrue(np.isfinite(x).all())
        self.assertGreaterEqual(x.min(), 0.0)
        for t in range(T):
            n = N + t + 1  # step t attends over N+t+1 keys
            self.assertLessEqual(np.abs(x[t, :, :, :n].sum(axis=-1) - 1.0).max(), tol,
                                 f"decode step {t} row sums")
            self.assertFalse(x[t, :, :, n:].any(), f"decode step {t} padding is not zero")
            # the newest key (the token consumed at this step) is a real, unpadded position
            self.assertEqual(x[t, :, :, :n].shape[-1], n)

        if "token_ids" in g:
            self.assertEqual(g["token_ids"].shape, (N + T,))
        if "token_entropy" in g or "token_varentropy" in g:
            e, v = g["token_entropy"], g["token_varentropy"]
            self.assertEqual(e.shape, (N + T,))
            self.assertEqual(v.shape, (N + T,))
            self.assertEqual(e.dtype, np.float32)
            self.assertEqual(v.dtype, np.float32)
            e, v = e[()], v[()]
            self.assertTrue(np.isfinite(e).all() and np.isfinite(v).all())
            self.assertGreaterEqual(float(e.min()), 0.0)
            self.assertGreaterEqual(float(v.min()), 0.0)
        if "logits" in g:
            lg = g["logits"]
            self.assertEqual(lg.dtype, np.float16)
            self.assertEqual(lg.shape[0], N + T)
            self.assertTrue(np.isfinite(lg[()]).all())
            if "token_entropy" in g:  # entropy bound: 0 <= H <= ln V
                self.assertLessEqual(float(g["token_entropy"][()].max()), np.log(lg.shape[1]) + 1e-3)
        if "queries" in g:
            q, k, v = g["queries"], g["keys"], g["values"]
            Dh = q.shape[-1]
            self.assertEqual(q.shape, (T, L, Hq, Dh))
            self.assertEqual(k.shape, (L, Hkv, N + T, Dh))
            self.assertEqual(v.shape, (L, Hkv, N + T, Dh))
            self.check_qk(q[()], k[()], x, N, T, Hq // Hkv, Dh)

    def check_qk(self, q, k, dec, N, T, group, Dh):
        """softmax(q . K^T / sqrt(Dh)) from the stored (RoPE'd) q and k reproduces the stored
        decode attention; the tolerance allows for float16 storage of q and k."""
        k = np.repeat(k.astype(np.float64), group, axis=1)  # [L, Hq, S, Dh]
        q = q.astype(np.float64)
        worst = 0.0
        for t in range(T):
            n = N + t + 1
            s = np.einsum("lhd,lhkd->lhk", q[t], k[:, :, :n]) / np.sqrt(Dh)
            s -= s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=-1, keepdims=True)
            worst = max(worst, float(np.abs(p - dec[t, :, :, :n]).max()))
        self.assertLess(worst, 2e-2, "attention recomputed from queries/keys differs")


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@unittest.skipIf(h5py is None, "h5py or numpy is not importable")
class ShippedDumpTest(DumpChecks, unittest.TestCase):
    def test_shipped_dump(self):
        self.assertTrue(os.path.isfile(DUMP), f"missing {DUMP}")
        with open(PROMPTS, encoding="utf-8") as f:
            n_prompts = sum(1 for line in f if line.strip())
        self.check_dump(DUMP, expect_samples=n_prompts, expect_prompts_sha=sha256(PROMPTS))

    def test_shipped_dump_has_stats_and_qkv(self):
        with h5py.File(DUMP, "r") as f:
            for name, g in f["samples"].items():
                for k in ("token_entropy", "token_varentropy", "queries", "keys", "values"):
                    self.assertIn(k, g, f"{name}/{k} missing")


@unittest.skipIf(h5py is None, "h5py or numpy is not importable")
class RecordTinyPromptTest(DumpChecks, unittest.TestCase):
    def test_record_tiny_prompt(self):
        missing = [m for m in ("torch", "transformers", "gguf", "accelerate")
                   if importlib.util.find_spec(m) is None]
        if missing:
            self.skipTest(f"not importable: {', '.join(missing)}")
        gguf = os.environ.get("KVCAL_SMOLLM2_GGUF")
        if not gguf:
            self.skipTest("KVCAL_SMOLLM2_GGUF is not set (path to SmolLM2-135M-Instruct .gguf)")
        if not os.path.isfile(gguf):
            self.skipTest(f"KVCAL_SMOLLM2_GGUF={gguf} is not a file")
        with tempfile.TemporaryDirectory() as tmp:
            prompts = os.path.join(tmp, "prompts.txt")
            with open(prompts, "w", encoding="utf-8") as f:
                f.write("\nThe capital of France is\n\n")
            out = os.path.join(tmp, "tiny.h5")
            cmd = [sys.executable, SCRIPT, "--gguf-file", gguf, "--prompts", prompts,
                   "--max-new-tokens", "2", "--token-stats", "--logits", "--qkv",
                   "--threads", str(min(2, os.cpu_count() or 1)), "--out", out]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            self.assertEqual(r.returncode, 0, f"recorder failed:\n{r.stderr[-3000:]}")
            self.assertEqual([n for n in os.listdir(tmp) if ".tmp." in n], [], "temp file left")
            self.check_dump(out, expect_samples=1, expect_T=2, expect_prompts_sha=sha256(prompts))
            with h5py.File(out, "r") as f:
                self.assertEqual(int(f.attrs["num_layers"]), 30)
                self.assertEqual(int(f.attrs["num_q_heads"]), 9)
                self.assertEqual(int(f.attrs["num_kv_heads"]), 3)
                self.assertIn("logits", f["samples/sample_000"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
