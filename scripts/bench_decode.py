#!/usr/bin/env python3
"""The CPU decode goals, measured: HEX decode against fp16 decode and a streaming read.

Runs bench_runtime's decode over a 32K-token cache (8 KV heads, Dh 128, a GQA
group of 1 and of 4) for fp16, kcvt4@int8 and hex4/3/2@int8, and the
streaming read on all threads, in interleaved rounds: each round runs every
build once, each run takes the fastest of its repetitions (the figures of one
run spread by 10-20% on a small shared host; the fastest of several is stable
to a few percent). Then, per round, the goals:

  - hex4@int8 at group 1 reads its bytes at >= 50% of the streaming read;
  - hex4@int8 is faster than fp16 by >= 0.8 x the byte ratio, groups 1 and 4;
  - hex3 and hex2 are no slower than hex4 (groups 1 and 4);
  - with two builds (a portable one and a -march=native one), the first is
    within 10% of the second on every case.

Usage:
  scripts/bench_decode.py                          # build/release, 3 rounds
  scripts/bench_decode.py --build build/release --build build/native --rounds 5
  scripts/bench_decode.py --reps 10 --json out/bench/decode_goals.json

Each build directory needs bin/bench_runtime (scripts/build.sh release makes
it; a native tree: cmake -DKVCAL_NATIVE=ON). Exit status 0 whether or not the
goals are met; 2 on a missing binary or a failed run.
"""
import argparse
import json
import os
import subprocess
import sys

CASES = ["fp16", "kcvt4@int8", "hex4@int8", "hex3@int8", "hex2@int8"]
FILTER = "^(decode/(" + "|".join(CASES) + ")/[14]/|streaming_read/2/)"


def run_once(binary, reps):
    """Fastest repetition of each benchmark: {name: (ms, bytes/s, kv_size_pct)}."""
    cmd = [binary, f"--benchmark_filter={FILTER}", f"--benchmark_repetitions={reps}", "--benchmark_format=json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench_decode: {binary} failed (exit {p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    best = {}
    for b in json.loads(p.stdout)["benchmarks"]:
        if b.get("run_type") != "iteration":
            continue
        name = b["run_name"].replace("/real_time", "")
        scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
        t = b["real_time"] * scale
        if name not in best or t < best[name][0]:
            best[name] = (t, b.get("bytes_per_second", 0.0), b.get("kv_size_pct", 100.0))
    return best


def goals(r):
    """The goals of one round of one build: a list of (goal, figure, met)."""
    out = []
    read = r["streaming_read/2"][1]
    h1 = r["decode/hex4@int8/1"]
    out.append(("hex4@int8 >= 50% of the streaming read (group 1)", f"{100 * h1[1] / read:.0f}%", h1[1] >= 0.5 * read))
    ratio = 100.0 / h1[2]  # fp16 bytes over hex4's
    for g in (1, 4):
        x = r[f"decode/fp16/{g}"][0] / r[f"decode/hex4@int8/{g}"][0]
        out.append((f"hex4@int8 >= {0.8 * ratio:.2f}x fp16 (0.8 x the byte ratio), group {g}", f"{x:.2f}x",
                    x >= 0.8 * ratio))
    for bits in (3, 2):
        for g in (1, 4):
            d = r[f"decode/hex{bits}@int8/{g}"][0] / r[f"decode/hex4@int8/{g}"][0] - 1
            out.append((f"hex{bits}@int8 no slower than hex4@int8, group {g}", f"{100 * d:+.1f}%", d <= 0))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--build", action="append", help="build directory (repeatable; default build/release)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--reps", type=int, default=6, help="repetitions per run, the fastest kept (default 6)")
    ap.add_argument("--json", help="write every round's figures and goals here")
    a = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    if a.rounds < 1 or a.reps < 1:
        sys.exit("bench_decode: --rounds and --reps must be at least 1")
    builds = a.build or ["build/release"]
    for b in builds:
        if not os.access(os.path.join(b, "bin", "bench_runtime"), os.X_OK):
            print(f"bench_decode: no {b}/bin/bench_runtime (build it first: scripts/build.sh release)", file=sys.stderr)
            return 2
    rounds = {b: [] for b in builds}
    for i in range(a.rounds):
        for b in builds:
            print(f"round {i + 1}/{a.rounds}: {b}", file=sys.stderr, flush=True)
            rounds[b].append(run_once(os.path.join(b, "bin", "bench_runtime"), a.reps))
    names = sorted(rounds[builds[0]][0], key=lambda n: (n.startswith("streaming"), n))
    report = {"builds": builds, "rounds": a.rounds, "reps": a.reps, "figures": {}, "goals": {}}
    for b in builds:
        print(f"\n{b}: fastest of {a.reps}, ms, by round (32K tokens, 8 KV heads, Dh 128; all threads)")
        for n in names:
            ms = [r[n][0] for r in rounds[b]]
            print(f"  {n:28s} " + "  ".join(f"{x:8.3f}" for x in ms))
        report["figures"][b] = {n: [r[n][0] for r in rounds[b]] for n in names}
        print(f"\n{b}: the goals, by round")
        per = [goals(r) for r in rounds[b]]
        report["goals"][b] = []
        for k, (label, _, _) in enumerate(per[0]):
            figs = [p[k][1] for p in per]
            met = all(p[k][2] for p in per)
            some = any(p[k][2] for p in per)
            verdict = "met" if met else ("met in some rounds" if some else "NOT met")
            print(f"  {label:62s} " + " / ".join(figs) + f"  -> {verdict}")
            report["goals"][b].append({"goal": label, "figures": figs, "verdict": verdict})
    if len(builds) >= 2:
        first, second = builds[0], builds[1]
        print(f"\n{first} against {second}: time ratio by round (goal: within 10%, i.e. <= 1.10)")
        worst = 0.0
        for n in names:
            if n.startswith("streaming"):
                continue
            xs = [p[n][0] / q[n][0] for p, q in zip(rounds[first], rounds[second])]
            worst = max(worst, sorted(xs)[len(xs) // 2])
            print(f"  {n:28s} " + " / ".join(f"{x:.2f}" for x in xs))
        print(f"  largest median ratio {worst:.2f} -> {'met' if worst <= 1.10 else 'NOT met'}")
        report["portable_vs_native_worst_median"] = worst
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
