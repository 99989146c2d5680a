#!/usr/bin/env python3
"""The whole pipeline on the real dump in data/ (mask-gen, profile-heads,
calibrate-entropy, bundle, validate, inspect), the h5py-only reader
scripts/kvcal_artifacts.py, the golden bundle, and the bad bundles validate must
name: a flipped byte (checksum), a CSR index out of range, a non-monotone indptr,
a truncated file, a foreign format, a newer version, a model-config mismatch;
the integrity seal (format_version 2) against hashlib, and h5py opening sealed
bundles.

Usage: python3 tests/python/test_bundle.py [path/to/kvcal]   (or KVCAL_BIN=...)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

try:
    import h5py
    import numpy as np
    MISSING = None
except ImportError as e:  # pragma: no cover
    MISSING = f"numpy and h5py are needed ({e})"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
REAL = os.path.join(ROOT, "data", "smollm2_attention.h5")
GOLDEN = os.path.join(ROOT, "tests", "golden", "bundle_v1.kvcal.h5")
KVCAL = os.environ.get("KVCAL_BIN")


def run(*args):
    return subprocess.run([KVCAL, *args], capture_output=True, text=True)


@unittest.skipIf(MISSING is not None, MISSING or "")
class Bundle(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not KVCAL or not os.access(KVCAL, os.X_OK):
            raise unittest.SkipTest("no kvcal binary: pass its path or set KVCAL_BIN")
        cls.tmp = tempfile.TemporaryDirectory(prefix="kvcal_bundle_")
        t = cls.tmp.name
        cls.masks, cls.heads, cls.entropy = (os.path.join(t, n) for n in ("m.h5", "h.h5", "e.h5"))
        for args in (["mask-gen", "--rows", "96", "--cols", "64", "--row-degree", "4", "--count", "2", "--out", cls.masks],
                     ["profile-heads", REAL, "--topk-frac", "0.1", "--out", cls.heads],
                     ["calibrate-entropy", REAL, "--page-size", "16", "--out", cls.entropy]):
            r = run("-q", *args)
            assert r.returncode == 0, r.stderr
        cls.bundle = os.path.join(t, "b.kvcal.h5")
        r = run("-q", "bundle", "--model", "SmolLM2-135M", "--masks", cls.masks, "--heads", cls.heads, "--entropy",
                cls.entropy, "--out", cls.bundle)
        assert r.returncode == 0, r.stderr

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def copy(self, name):
        path = os.path.join(self.tmp.name, name)
        shutil.copy(self.bundle, path)
        return path

    def reseal(self, path):
        # An edit with h5py leaves the old seal, which now fails first; sealed
        # again, the content checks behind it are what object.
        import kvcal_artifacts
        self.expect_invalid(path, ["integrity seal"])  # a digest or a length that no longer matches
        kvcal_artifacts.reseal(path)

    def expect_invalid(self, path, words):
        r = run("validate", path)
        self.assertEqual(r.returncode, 1, f"validate accepted {path}: {r.stdout}")
        for w in words:
            self.assertIn(w, r.stdout + r.stderr)
        self.assertLess(r.returncode, 128)

    def test_valid_and_inspect(self):
        r = run("validate", self.bundle, self.masks, self.heads, self.entropy, REAL)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(r.stdout.count(": valid "), 5)
        r = run("inspect", self.bundle, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["format"], "kvcal.bundle")
        self.assertEqual(j["model"], "SmolLM2-135M")
        self.assertEqual([m["id"] for m in j["masks"]], ["mask_0000", "mask_0001"])
        self.assertEqual(sum(j["heads"]["roles"].values()), 90)
        self.assertEqual(len(j["heads"]["layers"]), 30)
        for path in (self.masks, self.heads, self.entropy, REAL):
            r = run("inspect", path)
            self.assertEqual(r.returncode, 0, r.stderr)
            json.loads(run("inspect", path, "--json").stdout)

    def test_python_reader_agrees(self):
        import kvcal_artifacts
        a = kvcal_artifacts.load(self.bundle)
        self.assertEqual(a["format"], "kvcal.bundle")
        self.assertEqual(sorted(a["masks"]), ["mask_0000", "mask_0001"])
        d = a["masks"]["mask_0000"]["dense"]()
        self.assertEqual(d.shape, (96, 64))
        self.assertTrue((d.sum(axis=1) == 4).all() and (d.sum(axis=0) == 6).all())
        self.assertEqual(a["heads"]["role"].shape, (30, 3))
        self.assertAlmostEqual(float(a["heads"]["budget_ratio"].mean()), 0.5, places=5)
        self.assertEqual(a["manifest"]["model"], "SmolLM2-135M")
        # every dataset checksum in the manifest matches the bytes h5py reads
        import hashlib
        with h5py.File(self.bundle, "r") as f:
            for name, digest in a["manifest"]["datasets"].items():
                data = f[name][()]
                self.assertEqual(hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest(), digest, name)
        for path in (self.masks, self.heads, self.entropy, REAL):
            self.assertEqual(kvcal_artifacts.load(path)["format_version"], 1)

    def test_seal(self):
        import hashlib
        import kvcal_artifacts
        with open(self.bundle, "rb") as f:
            data = f.read()
        # The seal's digest is hashlib's SHA-256 of every byte after the 512-byte user block.
        digest = hashlib.sha256(data[512:]).hexdigest()
        self.assertEqual(data[:512].rstrip(b"\0").decode(),
                         f"kvcal-seal 1\nalgorithm sha256\noffset 512\nlength {len(data) - 512}\nsha256 {digest}\n")
        self.assertEqual(kvcal_artifacts.load(self.bundle)["seal"]["sha256"], digest)
        with h5py.File(self.bundle, "r") as f:  # libhdf5 skips the user block
            self.assertEqual(f.userblock_size, 512)
            self.assertEqual(int(f.attrs["format_version"]), 2)
            self.assertEqual(sorted(f), ["entropy", "heads", "masks"])
        r = run("validate", self.bundle)
        self.assertIn(f"seal verified (SHA-256 {digest[:16]}...", r.stdout)
        j = json.loads(run("inspect", self.bundle, "--json").stdout)
        self.assertEqual(j["integrity"], {"seal": "sha256", "verified": True, "sha256": digest,
                                          "covered_bytes": len(data) - 512})
        # A flipped byte anywhere: in the HDF5 bytes, in the seal's digest, in its padding.
        for at, words in ((len(data) // 2, ["checksum mismatch"]), (100, ["seal"]),
                          (400, ["seal", "damaged"]), (20, ["seal", "damaged"])):
            path = self.copy(f"seal{at}.h5")
            with open(path, "r+b") as f:
                f.seek(at)
                f.write(bytes([data[at] ^ 0x04]))
            self.expect_invalid(path, words)
            r = run("inspect", path)
            self.assertEqual(r.returncode, 1)
            self.assertEqual(r.stderr.count("\n"), 1, r.stderr)
            with self.assertRaises(ValueError):
                kvcal_artifacts.load(path)
        # Bytes appended after sealing, and a stripped seal (a v2 bundle with a zeroed user block).
        path = self.copy("longer.h5")
        with open(path, "ab") as f:
            f.write(b"\0" * 16)
        self.expect_invalid(path, ["appended"])
        path = self.copy("stripped.h5")
        with open(path, "r+b") as f:
            f.write(b"\0" * 512)
        self.expect_invalid(path, ["without its integrity seal"])

    def test_golden_bundle_still_reads(self):
        r = run("validate", GOLDEN)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("valid kvcal.bundle v1, no seal", r.stdout)
        r = run("inspect", GOLDEN)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = run("mask-certify", GOLDEN)  # a bundle is not a mask file: one clear error
        self.assertEqual(r.returncode, 1)

    def test_flipped_byte_is_a_checksum_mismatch(self):
        path = self.copy("flip.h5")
        with h5py.File(path, "r+") as f:
            d = f["heads/stability"]
            v = d[()]
            v[3, 1] = np.float32(v[3, 1] * 0.5 + 0.25)
            d[...] = v
        self.reseal(path)
        self.expect_invalid(path, ["checksum mismatch", "/heads/stability"])

    def test_one_flipped_byte_in_the_file(self):
        path = self.copy("byte.h5")
        with h5py.File(path, "r") as f:
            offset = f["masks/mask_0001/indices"].id.get_offset()  # contiguous: the raw bytes' file offset
        self.assertIsNotNone(offset)
        with open(path, "r+b") as f:
            f.seek(offset + 8)
            b = f.read(1)
            f.seek(offset + 8)
            f.write(bytes([b[0] ^ 0x01]))
        self.reseal(path)
        self.expect_invalid(path, ["checksum mismatch", "/masks/mask_0001/indices"])

    def test_csr_defects(self):
        path = self.copy("range.h5")
        with h5py.File(path, "r+") as f:
            f["masks/mask_0000/indices"][5] = 64 + 3
        self.reseal(path)
        self.expect_invalid(path, ["out of range", "mask_0000"])
        path = self.copy("indptr.h5")
        with h5py.File(path, "r+") as f:
            ip = f["masks/mask_0001/indptr"][()]
            ip[10], ip[11] = ip[11], ip[10]
            f["masks/mask_0001/indptr"][...] = ip
        self.reseal(path)
        self.expect_invalid(path, ["indptr", "mask_0001"])

    def test_damaged_foreign_and_newer_files(self):
        size = os.path.getsize(self.bundle)
        path = self.copy("cut.h5")
        with open(path, "r+b") as f:
            f.truncate(size // 2)
        self.expect_invalid(path, ["cut.h5"])
        path = self.copy("format.h5")
        with h5py.File(path, "r+") as f:
            f.attrs["format"] = np.bytes_("kvcal.something")
        self.reseal(path)
        self.expect_invalid(path, ["unknown format"])
        path = self.copy("newer.h5")
        with h5py.File(path, "r+") as f:
            f.attrs["format_version"] = np.int64(7)
        self.reseal(path)
        self.expect_invalid(path, ["newer"])
        r = run("validate", os.path.join(self.tmp.name, "absent.h5"))
        self.assertEqual(r.returncode, 1)

    def test_model_config(self):
        cfg = os.path.join(self.tmp.name, "config.json")
        good = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
        with open(cfg, "w") as f:
            json.dump(good, f)
        out = os.path.join(self.tmp.name, "cfg.kvcal.h5")
        r = run("-q", "bundle", "--model", "m", "--masks", self.masks, "--heads", self.heads, "--entropy",
                self.entropy, "--model-config", cfg, "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        with h5py.File(out, "r") as f:
            self.assertEqual(json.loads(f.attrs["manifest"])["model_config"]["head_dim"], 64)
        for bad, word in (({**good, "num_hidden_layers": 24}, "num_hidden_layers"),
                          ({**good, "num_key_value_heads": 9}, "num_key_value_heads"),
                          ({**good, "head_dim": 128}, "head dimension")):
            with open(cfg, "w") as f:
                json.dump(bad, f)
            out = os.path.join(self.tmp.name, "bad.kvcal.h5")
            r = run("-q", "bundle", "--model", "m", "--masks", self.masks, "--heads", self.heads, "--entropy",
                    self.entropy, "--model-config", cfg, "--out", out)
            self.assertEqual(r.returncode, 1)
            self.assertIn(word, r.stderr)
            self.assertEqual(r.stderr.count("\n"), 1)
            self.assertFalse(os.path.exists(out))
        # parts of the wrong kind are refused
        r = run("-q", "bundle", "--model", "m", "--masks", self.heads, "--heads", self.heads, "--entropy",
                self.entropy, "--out", out)
        self.assertEqual(r.returncode, 1)
        self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and not args[0].startswith("-"):
        KVCAL = os.path.abspath(args.pop(0))
    if MISSING:
        print(f"skipping: {MISSING}", file=sys.stderr)
    unittest.main(argv=[sys.argv[0]] + args, verbosity=2)
