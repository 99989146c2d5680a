#!/usr/bin/env python3
"""The recorder's sharding over torchrun ranks (scripts/record_attention.py).

(a) Without torch: shard_indices gives every prompt to exactly one rank, in order, for every
    prompt and rank count; shard_path names one file per rank; shard_from_env reads and checks
    torchrun's variables; a rank with no prompt writes nothing and exits 0 (run as a process,
    before torch is imported).
(b) With torch, transformers and KVCAL_SMOLLM2_GGUF (the SmolLM2-135M-Instruct .gguf file):
    three prompts recorded by two ranks (RANK/WORLD_SIZE set as torchrun sets them) give two
    files whose samples are exactly those of a single-process recording. Skipped otherwise.

Run: python3 tests/python/test_record_shards.py   (exit 0 on pass or skip)
"""
import importlib.util
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "record_attention.py")

spec = importlib.util.spec_from_file_location("record_attention", SCRIPT)
rec = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rec)


class ShardLogic(unittest.TestCase):
    def test_every_prompt_once(self):
        for n in range(0, 12):
            for world in range(1, 7):
                got = []
                for rank in range(world):
                    part = rec.shard_indices(n, rank, world)
                    self.assertEqual(part, sorted(part))
                    # balanced: sizes differ by at most one
                    self.assertLessEqual(len(part), -(-n // world))
                    self.assertGreaterEqual(len(part), n // world)
                    got += part
                self.assertEqual(sorted(got), list(range(n)), f"n={n} world={world}")

    def test_paths(self):
        self.assertEqual(rec.shard_path("d/x.h5", 0, 1), "d/x.h5")
        self.assertEqual(rec.shard_path("d/x.h5", 3, 8), "d/x.rank00003.h5")
        self.assertEqual(rec.shard_path("d/x_{rank}.h5", 12, 16), "d/x_00012.h5")
        paths = {rec.shard_path("x.h5", r, 5) for r in range(5)}
        self.assertEqual(len(paths), 5)

    def test_env(self):
        self.assertEqual(rec.shard_from_env({}), (0, 1, 0, 1))
        env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
        self.assertEqual(rec.shard_from_env(env), (5, 8, 1, 4))
        for bad in ({"RANK": "8", "WORLD_SIZE": "8"}, {"RANK": "-1", "WORLD_SIZE": "2"},
                    {"RANK": "x", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "0"},
                    {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}):
            with self.assertRaises(rec.RecordError, msg=str(bad)):
                rec.shard_from_env(bad)

    def test_idle_rank_writes_nothing(self):
        with tempfile.TemporaryDirectory() as tmp:
            prompts = os.path.join(tmp, "p.txt")
            with open(prompts, "w") as f:
                f.write("one\ntwo\n")
            env = dict(os.environ, RANK="2", WORLD_SIZE="3")
            r = subprocess.run([sys.executable, SCRIPT, "--model", "unused", "--prompts", prompts,
                                "--out", os.path.join(tmp, "d.h5")],
                               env=env, capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("no prompt left for this rank", r.stderr)
            self.assertEqual(sorted(os.listdir(tmp)), ["p.txt"])
            env["RANK"] = "3"
            r = subprocess.run([sys.executable, SCRIPT, "--model", "unused", "--prompts", prompts,
                                "--out", os.path.join(tmp, "d.h5")],
                               env=env, capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 2)
            self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
            self.assertIn("RANK=3 WORLD_SIZE=3", r.stderr)


def have_recording_stack():
    gguf = os.environ.get("KVCAL_SMOLLM2_GGUF", "")
    if not gguf or not os.path.isfile(gguf):
        return "KVCAL_SMOLLM2_GGUF does not name the SmolLM2-135M-Instruct .gguf file"
    for mod in ("torch", "transformers", "h5py", "numpy"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (recording needs torch and transformers)"
    return None


@unittest.skipIf(have_recording_stack() is not None, str(have_recording_stack()))
class ShardedRecording(unittest.TestCase):
    def test_two_ranks_equal_one(self):
        import h5py
        import numpy as np
        gguf = os.environ["KVCAL_SMOLLM2_GGUF"]
        with tempfile.TemporaryDirectory() as tmp:
            prompts = os.path.join(tmp, "p.txt")
            with open(prompts, "w") as f:
                f.write("Hi.\nName a colour.\nCount to three.\n")
            base = [sys.executable, SCRIPT, "--gguf-file", gguf, "--prompts", prompts,
                    "--max-new-tokens", "2", "--max-prompt-tokens", "16", "--dtype", "float32",
                    "--device", "cpu", "--threads", "1"]
            env1 = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
            subprocess.run(base + ["--out", os.path.join(tmp, "one.h5")], env=env1, check=True,
                           capture_output=True, timeout=600)
            for r in range(2):
                subprocess.run(base + ["--out", os.path.join(tmp, "two.h5")], check=True,
                               env=dict(env1, RANK=str(r), WORLD_SIZE="2"), capture_output=True,
                               timeout=600)
            with h5py.File(os.path.join(tmp, "one.h5")) as one:
                shards = [h5py.File(os.path.join(tmp, f"two.rank{r:05d}.h5")) for r in range(2)]
                seen = {}
                for r, s in enumerate(shards):
                    self.assertEqual(int(s.attrs["shard_rank"]), r)
                    for name in s["samples"]:
                        seen[name] = s["samples"][name]
                self.assertEqual(sorted(seen), sorted(one["samples"]))
                for name, g in seen.items():
                    for ds in ("prefill", "decode", "token_ids"):
                        np.testing.assert_array_equal(g[ds][()], one["samples"][name][ds][()])
                for s in shards:
                    s.close()


if __name__ == "__main__":
    unittest.main()
