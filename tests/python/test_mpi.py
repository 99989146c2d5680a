#!/usr/bin/env python3
"""kvcal profile-heads, calibrate-entropy and mask-gen under mpirun (kvcal built with MPI).

Every output dataset (and every root attribute but the provenance ones: command_line,
created_utc) must be byte-identical to the single process (run without mpirun) for 1, 2, 3 and 4
ranks, on two dumps with samples of uneven sizes and on more ranks than samples. Faults: a bad
sample read by one rank, a rank that fails late (after the others finished), a rank that fails
first while the others still work, and a rank killed mid-run: each ends with a non-zero exit,
one kvcal error line naming the rank and the file, and no output or temporary file.
mask-gen --count (repeated and uncertified seeds, the best uncertified kept, 2-lifts, more ranks
than masks) writes the same datasets, attributes and summary as the single process for 1-4 ranks;
its failures give one line. eval-fidelity writes the same CSV as the single process for 1-4 ranks
on the recorded SmolLM2 dumps (one long sample; three samples of uneven sizes), with and without
a bundle (hetero, CHESS re-selection), with items split by layer and by whole sample
(CHESS), and with more ranks than items; a NaN value in a layer one rank reads gives one error line
naming that rank and the file, and no CSV.

Usage: python3 tests/python/test_mpi.py path/to/kvcal path/to/mpiexec [unittest options]
Skips (with a message) without numpy/h5py or when the binary has no MPI. Running as root sets
Open MPI's allow-run-as-root variables; oversubscription is allowed (more ranks than cores).
"""
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

try:
    import h5py
    import numpy as np
    MISSING = None
except ImportError as e:  # pragma: no cover
    MISSING = f"numpy and h5py are needed ({e})"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATOR = os.path.join(ROOT, "scripts", "make_synthetic_dump.py")
KVCAL = MPIEXEC = None
PROVENANCE = {"command_line", "created_utc"}
TIMEOUT = 120

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1")
# A run without mpirun must not look launched.
SERIAL_ENV = {k: v for k, v in ENV.items()
              if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))}


def make_dump(path, args):
    subprocess.run([sys.executable, GENERATOR, *args.split(), "--out", path], check=True,
                   capture_output=True, timeout=TIMEOUT)


def add_token_data(path, seed, logits_samples):
    """Adds logits [N+T, V] to the named samples and token statistics to the others."""
    rng = np.random.default_rng(seed)
    with h5py.File(path, "r+") as f:
        for name, g in f["samples"].items():
            rows = int(g.attrs["prompt_len"]) + int(g["decode"].shape[0])
            if name in logits_samples:
                g["logits"] = (rng.standard_normal((rows, 97)) * 3).astype(np.float32)
            else:
                g["token_entropy"] = rng.uniform(0, 4, rows)
                g["token_varentropy"] = rng.uniform(0, 9, rows)


def datasets(path):
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out[name] = (obj.dtype.str, obj.shape, obj[()].tobytes())
        f.visititems(visit)
        attrs = {k: (v.tobytes() if hasattr(v, "tobytes") else v) for k, v in f.attrs.items()
                 if k not in PROVENANCE}
    return out, attrs


def object_attrs(path):
    """Attributes of every group and dataset (the root's provenance ones left out)."""
    out = {}
    with h5py.File(path, "r") as f:
        def take(name, obj):
            for k, v in obj.attrs.items():
                if name == "/" and k in PROVENANCE:
                    continue
                out[(name, k)] = v.tobytes() if hasattr(v, "tobytes") else v
        take("/", f)
        f.visititems(take)
    return out


class MpiBase(unittest.TestCase):
    def run_kvcal(self, ranks, args, out):
        cmd = [KVCAL, *args, "--out", out]
        if ranks == 0:
            return subprocess.run(cmd, env=SERIAL_ENV, capture_output=True, text=True, timeout=TIMEOUT)
        return subprocess.run([MPIEXEC, "-n", str(ranks), *cmd], env=ENV, capture_output=True,
                              text=True, timeout=TIMEOUT)

    def leftovers(self, out):
        base = os.path.basename(out)
        return [f for f in os.listdir(os.path.dirname(out)) if f.startswith(base)]

    def check_fails(self, ranks, args, out, rank, path):
        r = self.run_kvcal(ranks, args, out)
        self.assertNotEqual(r.returncode, 0)
        lines = [l for l in r.stderr.splitlines() if l.startswith("kvcal ")]
        self.assertEqual(len(lines), 1, r.stderr)
        self.assertIn(f"error: rank {rank}: ", lines[0])
        self.assertIn(path, lines[0])
        self.assertEqual(self.leftovers(out), [], r.stderr)
        return lines[0]


class MpiRuns(MpiBase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        d = cls.dir = cls.tmp.name
        # Uneven samples: prompt lengths and steps differ per sample; 3 layers.
        cls.a = os.path.join(d, "a.h5")
        make_dump(cls.a, "--layers 3 --q-heads 6 --kv-heads 2 --samples 3 --prompt-len 37,90,29 "
                         "--steps 9,4,17 --dtype float16 --seed 21")
        cls.b = os.path.join(d, "b.h5")
        make_dump(cls.b, "--layers 3 --q-heads 6 --kv-heads 2 --samples 2 --prompt-len 140,33 "
                         "--steps 6,11 --dtype float32 --store kv --seed 22")
        # one sample of 2 layers: fewer items than 3 ranks
        cls.c = os.path.join(d, "c.h5")
        make_dump(cls.c, "--layers 2 --q-heads 4 --kv-heads 2 --samples 1 --prompt-len 50 "
                         "--steps 8 --dtype float16 --seed 23")
        add_token_data(cls.a, 1, {"sample_000", "sample_002"})
        add_token_data(cls.b, 2, {"sample_001"})
        add_token_data(cls.c, 3, {"sample_000"})

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def check_same(self, args, tag, ranks=(1, 2, 3, 4)):
        ref = os.path.join(self.dir, f"{tag}_serial.h5")
        r = self.run_kvcal(0, args, ref)
        self.assertEqual(r.returncode, 0, r.stderr)
        want_ds, want_attrs = datasets(ref)
        for n in ranks:
            out = os.path.join(self.dir, f"{tag}_{n}.h5")
            r = self.run_kvcal(n, args, out)
            self.assertEqual(r.returncode, 0, f"{n} ranks: {r.stderr}")
            got_ds, got_attrs = datasets(out)
            self.assertEqual(sorted(got_ds), sorted(want_ds))
            for name in want_ds:
                self.assertEqual(got_ds[name], want_ds[name], f"{tag}, {n} ranks: dataset {name} differs")
            self.assertEqual(got_attrs, want_attrs, f"{tag}, {n} ranks: attributes differ")
            # the summary comes once, from rank 0
            self.assertEqual(r.stdout, self.run_kvcal(0, args, ref + ".again").stdout)

    def test_profile_heads_identical(self):
        self.check_same([ "profile-heads", self.a, self.b, "--topk", "8", "--budget", "0.95"], "heads")

    def test_profile_heads_more_ranks_than_items(self):
        self.check_same(["profile-heads", self.c, "--topk-frac", "0.2", "--budget", "0.95"], "heads_c",
                        ranks=(2, 3))

    def test_calibrate_entropy_identical(self):
        self.check_same(["calibrate-entropy", self.a, self.b, "--page-size", "4", "--percentile", "90"],
                        "entropy")

    def test_calibrate_entropy_more_ranks_than_samples(self):
        self.check_same(["calibrate-entropy", self.c, "--page-size", "4"], "entropy_c", ranks=(2, 3))

    def corrupt(self, src, dst, sample, layer, dataset="decode"):
        with open(src, "rb") as f, open(dst, "wb") as g:
            g.write(f.read())
        with h5py.File(dst, "r+") as f:
            ds = f["samples"][sample][dataset]
            if dataset == "decode":
                row = ds[0, layer]
                row[0, 0] = np.nan
                ds[0, layer] = row
            else:
                row = ds[0]
                row[3] = np.nan
                ds[0] = row

    def test_bad_file_on_one_rank(self):
        # b.h5 (the last file) is read by the last of 2 ranks: NaN logits in its second sample
        bad = os.path.join(self.dir, "b_bad_logits.h5")
        self.corrupt(self.b, bad, "sample_001", 0, dataset="logits")
        line = self.check_fails(2, ["calibrate-entropy", self.a, bad, "--page-size", "4"],
                                os.path.join(self.dir, "bad_entropy.h5"), 1, bad)
        self.assertIn("sample 'sample_001'", line)

    def test_rank_fails_late(self):
        # the very last work item (last layer of the last sample) fails on the last rank
        bad = os.path.join(self.dir, "b_bad_last.h5")
        self.corrupt(self.b, bad, "sample_001", 2)
        self.check_fails(3, ["profile-heads", self.a, bad, "--topk", "8", "--budget", "0.95"],
                         os.path.join(self.dir, "late.h5"), 2, bad)

    def test_rank_fails_first(self):
        # the first item fails on rank 0 while ranks 1 and 2 work; they stop, all exit non-zero
        bad = os.path.join(self.dir, "a_bad_first.h5")
        self.corrupt(self.a, bad, "sample_000", 0)
        self.check_fails(3, ["profile-heads", bad, self.b, "--topk", "8", "--budget", "0.95"],
                         os.path.join(self.dir, "first.h5"), 0, bad)

    def test_rank_killed(self):
        # rank 1 is stopped as soon as it exists, then killed while rank 0 waits for it:
        # mpirun ends the job, nothing is written
        out = os.path.join(self.dir, "killed.h5")
        p = subprocess.Popen([MPIEXEC, "-n", "2", KVCAL, "profile-heads", self.a, self.b, "--topk", "8",
                              "--budget", "0.95", "--out", out], env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        victim, deadline = None, time.time() + 30
        while victim is None and time.time() < deadline and p.poll() is None:
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        env = f.read().split(b"\0")
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().split(b"\0")
                except OSError:
                    continue
                if (b"OMPI_COMM_WORLD_RANK=1" in env and cmd and cmd[0].endswith(b"kvcal")
                        and out.encode() in cmd):
                    victim = int(pid)
                    os.kill(victim, signal.SIGSTOP)
                    break
        self.assertIsNotNone(victim, "rank 1 was not found")
        time.sleep(1.0)  # rank 0 reaches a point where it waits for rank 1
        os.kill(victim, signal.SIGKILL)
        _, err = p.communicate(timeout=TIMEOUT)
        self.assertNotEqual(p.returncode, 0, err)
        self.assertEqual(self.leftovers(out), [], err)


class MpiMasks(MpiBase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = cls.tmp.name

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    # mask-gen --count: the candidates of each mask split over the ranks; the winners (and the
    # seeds skipped as repeats or uncertified) must be those of the single process.
    MASK_CASES = {
        # 24 possible masks: many seeds repeat an earlier mask
        "repeats": "--rows 4 --cols 4 --row-degree 3 --count 20 --tries 60 --seed 3",
        # uncertified seeds, and the best uncertified one kept when every try fails
        "best": "--rows 6 --cols 6 --row-degree 2 --count 4 --tries 2 --seed 3 --allow-non-ramanujan",
        # 2-lifts, some uncertified
        "lifts": "--rows 96 --cols 128 --row-degree 4 --count 3 --lift-to 384 --tries 20 --seed 3",
    }

    def check_masks(self, args, tag, ranks):
        ref = os.path.join(self.dir, f"{tag}_serial.h5")
        r = self.run_kvcal(0, args, ref)
        self.assertEqual(r.returncode, 0, r.stderr)
        want = (datasets(ref), object_attrs(ref), r.stdout)
        for n in ranks:
            out = os.path.join(self.dir, f"{tag}_{n}.h5")
            r = self.run_kvcal(n, args, out)
            self.assertEqual(r.returncode, 0, f"{n} ranks: {r.stderr}")
            got = (datasets(out), object_attrs(out), r.stdout)
            self.assertEqual(got[0], want[0], f"{tag}, {n} ranks: datasets differ")
            self.assertEqual(got[1], want[1], f"{tag}, {n} ranks: attributes differ")
            self.assertEqual(got[2], want[2], f"{tag}, {n} ranks: summary differs")

    def test_mask_gen_identical(self):
        for tag, args in self.MASK_CASES.items():
            with self.subTest(tag):
                self.check_masks(["mask-gen", *args.split()], f"masks_{tag}", ranks=(1, 2, 3))

    def test_mask_gen_more_ranks_than_masks(self):
        self.check_masks(["mask-gen", "--rows", "6", "--cols", "6", "--row-degree", "2", "--seed", "3"],
                         "masks_one", ranks=(3, 4))

    def check_one_error(self, ranks, args, out, text):
        r = self.run_kvcal(ranks, args, out)
        self.assertNotEqual(r.returncode, 0)
        lines = [l for l in r.stderr.splitlines() if l.startswith("kvcal ")]
        self.assertEqual(len(lines), 1, r.stderr)
        self.assertIn(text, lines[0])
        self.assertEqual(self.leftovers(out), [], r.stderr)
        self.assertEqual(r.stdout, "")
        return lines[0]

    def test_mask_gen_fails(self):
        # no certified candidate in 2 tries for mask 1: decided by rank 0 after a round
        out = os.path.join(self.dir, "masks_fail.h5")
        args = ["mask-gen", "--rows", "6", "--cols", "6", "--row-degree", "2", "--count", "4", "--tries", "2",
                "--seed", "3"]
        for n in (2, 3):
            line = self.check_one_error(n, args, out, "error: rank 0: mask 1/4: no certified Ramanujan candidate "
                                                      "in 2 tries (seeds 3..4)")
        # an unusable output path, checked by rank 0 before any work
        bad = os.path.join(self.dir, "no_such_dir", "m.h5")
        r = self.run_kvcal(3, args[:-4], bad)
        self.assertNotEqual(r.returncode, 0)
        lines = [l for l in r.stderr.splitlines() if l.startswith("kvcal ")]
        self.assertEqual(len(lines), 1, r.stderr)
        self.assertIn("rank 0: ", lines[0])
        self.assertIn(bad, lines[0])

class MpiFidelity(MpiBase):
    DATA = os.path.join(ROOT, "data")
    LONG = os.path.join(DATA, "smollm2_long.h5")      # 1 sample, N = 383, T = 16, 30 layers
    SHORT = os.path.join(DATA, "smollm2_attention.h5")  # 3 samples, N = 69, 81, 72, T = 12
    # every kind of method a layer at a time (hex with the expander mask, H2O, hetero from the
    # bundle), and with CHESS (whole samples)
    LAYERS = "fp16,kcvt3,hex4,h2o4,h2o-evict,hetero"
    CHESS = "kcvt4,chess-conservative,chess-aggressive,hetero"

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = cls.tmp.name
        cls.made = {}

    # Each test is its own ctest test (process): the bundle is made when used.
    def bundle(self):
        # as in cli.eval_fidelity_bundle: the mask, a head profile for hetero, and the entropy
        # thresholds CHESS re-selects with
        if "bundle" not in self.made:
            def run(*a):
                subprocess.run([KVCAL, "-q", *a], env=SERIAL_ENV, cwd=self.dir, check=True,
                               capture_output=True, timeout=TIMEOUT)
            run("mask-gen", "--rows", "96", "--cols", "64", "--sparsity", "0.03125", "--method", "lift",
                "--seed", "5", "--out", "m.h5")
            run("profile-heads", self.SHORT, "--topk-frac", "0.2", "--drift-window", "4", "--out", "heads.h5")
            run("calibrate-entropy", self.SHORT, "--page-size", "16", "--out", "ent.h5")
            run("bundle", "--model", "SmolLM2-135M", "--masks", "m.h5", "--heads", "heads.h5", "--entropy",
                "ent.h5", "--out", "b.h5")
            self.made["bundle"] = os.path.join(self.dir, "b.h5")
        return self.made["bundle"]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def check_csv(self, dump, methods, tag, ranks, bundle=True):
        # -v: the rows' unrounded values (hex floats), which must match too
        args = ["-v", "eval-fidelity", "--dump", dump, "--methods", methods]
        if dump != self.LONG:
            args += ["--block", "48"]  # the short prompts (69-81 tokens) hold a full block to compress
        if bundle:
            args += ["--bundle", self.bundle()]
        ref = os.path.join(self.dir, f"{tag}_serial.csv")
        r = self.run_kvcal(0, args, ref)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(ref, "rb") as f:
            want = f.read()
        self.assertEqual(want.count(b"\n"), 1 + len(methods.split(",")))
        # something was compressed: not every method is exact
        self.assertTrue(any(float(row.split(b",")[2]) > 0 for row in want.splitlines()[1:]), want)
        exact = [l for l in r.stderr.splitlines() if " exact: " in l]
        self.assertEqual(len(exact), len(methods.split(",")), r.stderr)
        for n in ranks:
            out = os.path.join(self.dir, f"{tag}_{n}.csv")
            r = self.run_kvcal(n, args, out)
            self.assertEqual(r.returncode, 0, f"{n} ranks: {r.stderr}")
            with open(out, "rb") as f:
                self.assertEqual(f.read(), want, f"{tag}, {n} ranks: the CSV differs")
            self.assertEqual([l for l in r.stderr.splitlines() if " exact: " in l], exact,
                             f"{tag}, {n} ranks: the unrounded values differ")
            self.assertEqual(self.leftovers(out), [os.path.basename(out)])
            # the summary table comes once, from rank 0
            self.assertEqual(r.stdout.count("rel err mean"), 1, r.stdout)

    def test_eval_fidelity_identical(self):
        # 30 layer items of one sample
        self.check_csv(self.LONG, "kcvt3,hex4,h2o-evict,hetero", "long", ranks=(1, 2, 3))
        # 3 x 30 layer items of uneven samples; ranks split inside samples
        self.check_csv(self.SHORT, self.LAYERS, "short", ranks=(4,))

    def test_eval_fidelity_whole_samples_identical(self):
        # CHESS: whole-sample items, re-selected on the bundle's entropy thresholds
        self.check_csv(self.SHORT, self.CHESS, "short_chess", ranks=(2, 3))

    def test_eval_fidelity_more_ranks_than_items(self):
        # 3 whole-sample items for 4 ranks (without a bundle: CHESS selects once after the prompt)
        self.check_csv(self.SHORT, "kcvt4,chess-moderate", "short_chess_nb", ranks=(4,), bundle=False)

    def plant_nan(self, dst, sample, layer):
        with open(self.SHORT, "rb") as f, open(dst, "wb") as g:
            g.write(f.read())
        with h5py.File(dst, "r+") as f:
            ds = f["samples"][sample]["values"]
            v = ds[layer]
            v[1, 5, 3] = np.nan
            ds[layer] = v

    def test_eval_fidelity_fails_on_one_rank(self):
        # A NaN value in the last layer of the last sample: only the last rank reads it.
        bad = os.path.join(self.dir, "nan_last.h5")
        self.plant_nan(bad, "sample_002", 29)
        args = ["eval-fidelity", "--dump", bad, "--methods", "kcvt4,hex4"]
        out = os.path.join(self.dir, "nan_last.csv")
        r = self.run_kvcal(0, args, out)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("sample 'sample_002', layer 29: non-finite key or value", r.stderr)
        self.assertEqual(self.leftovers(out), [])
        for n in (3,):
            line = self.check_fails(n, args, out, n - 1, bad)
            self.assertIn("sample 'sample_002', layer 29: non-finite key or value", line)
        # In the first layer of the first sample: rank 0 fails while the others work.
        bad = os.path.join(self.dir, "nan_first.h5")
        self.plant_nan(bad, "sample_000", 0)
        line = self.check_fails(3, ["eval-fidelity", "--dump", bad, "--methods", "kcvt4,hex4"],
                                os.path.join(self.dir, "nan_first.csv"), 0, bad)
        self.assertIn("sample 'sample_000', layer 0: non-finite key or value", line)


def main():
    global KVCAL, MPIEXEC
    args = sys.argv[1:]
    if len(args) < 2:
        print("usage: test_mpi.py KVCAL MPIEXEC [unittest options]", file=sys.stderr)
        return 2
    KVCAL, MPIEXEC = os.path.abspath(args[0]), args[1]
    if MISSING:
        print(f"skipped: {MISSING}")
        return 0
    version = subprocess.run([KVCAL, "--version"], capture_output=True, text=True).stdout
    if "MPI (" not in version:
        print(f"skipped: {KVCAL} is built without MPI ({version.strip()})")
        return 0
    unittest.main(argv=[sys.argv[0]] + args[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
