#!/usr/bin/env python3
"""The CPU decode goals, measured: HEX decode against fp16 decode and a streaming read.

Runs bench_runtime's decode over a 32K-token cache (8 KV heads, Dh 128, a GQA
group of 1 and of 4) for fp16, kcvt4@int8 and hex4/3/2@int8, and the
streaming read on all threads, in interleaved rounds: each round runs every
build once, each run takes the fastest of its repetitions (the figures of one
run spread by 10-20% on a small shared host; the fastest of several is stable
to a few percent). The decode cycles through copies of the layer that fill
twice the last-level cache and the read covers at least four times it, so
that both come from memory as in a model's decode step (building the copies
takes a few seconds per method on a large-LLC host). Then, per round, the
goals:

  - hex4@int8 at group 1 reads its bytes at >= 50% of the streaming read;
  - hex4@int8 is faster than fp16 by >= 0.8 x the byte ratio, groups 1 and 4;
  - hex3 and hex2 are no slower than hex4 (groups 1 and 4);
  - with two builds (a portable one and a -march=native one), the first is
    within 10% of the second on every case.

It also serves A/Bs of a change: --lib runs the first build's benchmark
binary against copies of libkvcal_runtime.so (its RUNPATH yields to
LD_LIBRARY_PATH; the runs are then the libraries only), --env adds runs of
the first build's binary with environment variables of their own (a SIMD
target forced with KVCAL_BENCH_TARGET, a knob read from the environment),
--filter picks other benchmarks, --threads 1 gives the steadiest figures on
a small host (two threads are bimodal there), and --layers 1 times one copy
of the layer, in the LLC where it fits: against the default run, what memory
costs the decode.

Usage:
  scripts/bench_decode.py                          # build/release, 3 rounds
  scripts/bench_decode.py --build build/release --build build/native --rounds 5
  scripts/bench_decode.py --reps 10 --json out/bench/decode_goals.json
  scripts/bench_decode.py --threads 1 --layers 1 --filter '^decode/hex4@int8/'   # the LLC's figure
  # A/B: the library before a change (copied aside) against the rebuilt one
  cp -a build/native/lib /tmp/before && <change, rebuild>
  scripts/bench_decode.py --build build/native --lib /tmp/before --lib build/native/lib
      --threads 1 --filter '^decode/hex4@int8/' --rounds 5          (one command)
  # The portable build's other SIMD targets forced, interleaved with the host's best
  scripts/bench_decode.py --env AVX3:KVCAL_BENCH_TARGET=AVX3,KVCAL_AVX_VNNI=0
      --env AVX2:KVCAL_BENCH_TARGET=AVX2,KVCAL_AVX_VNNI=0 --filter '^decode/hex[432]@int8/[14]/'

Each build directory needs bin/bench_runtime (scripts/build.sh release makes
it; a native tree: cmake -DKVCAL_NATIVE=ON). The goals are printed where the
filter covers them and neither --threads nor --layers is given (they are
stated for all threads, from memory, against the two-thread read); with two
or more runs per round (builds or libraries) the first is compared with the
second. Exit status 0 whether or not the goals are
met; 2 on a missing binary or library, or a failed run.
"""
import argparse
import json
import os
import subprocess
import sys

CASES = ["fp16", "kcvt4@int8", "hex4@int8", "hex3@int8", "hex2@int8"]
FILTER = "^(decode/(" + "|".join(CASES) + ")/[14]/|streaming_read/2/)"


def die(message):
    print(f"bench_decode: {message}", file=sys.stderr)
    sys.exit(2)


def parse_env(spec):
    """--env's LABEL:VAR=VALUE[,VAR=VALUE...] as (LABEL, {VAR: VALUE})."""
    label, sep, rest = spec.partition(":")
    if not sep or not label.strip() or not rest:
        die(f"--env {spec!r}: expected LABEL:VAR=VALUE[,VAR=VALUE...]")
    extra = {}
    for item in rest.split(","):
        var, eq, value = item.partition("=")
        if not eq or not var.isidentifier():
            die(f"--env {spec!r}: {item!r} is not VAR=VALUE")
        if var in extra:
            die(f"--env {spec!r}: {var} given twice")
        extra[var] = value
    return label, extra


def run_once(binary, env, bench_filter, reps):
    """Fastest repetition of each benchmark, {name: (ms, bytes/s, kv_size_pct)}, the
    kernels' SIMD target the binary reported (its context's simd_target) and how far
    ahead its code kernels requested codes: (prefetch_far, prefetch_near), each None
    from binaries without it."""
    cmd = [binary, f"--benchmark_filter={bench_filter}", f"--benchmark_repetitions={reps}", "--benchmark_format=json"]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no message"])[-1]
        die(f"{binary} failed (exit {p.returncode}): {last}")
    try:
        out = json.loads(p.stdout) if p.stdout.strip() else {}
        found = out.get("benchmarks", [])
        target = out.get("context", {}).get("simd_target", "unknown")
        far = out.get("context", {}).get("prefetch_far"), out.get("context", {}).get("prefetch_near")
    except (ValueError, AttributeError) as e:
        die(f"{binary} printed no benchmark results ({e})")
    best = {}
    for b in found:
        if b.get("run_type") != "iteration":
            continue
        name = b["run_name"].replace("/real_time", "")
        scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
        t = b["real_time"] * scale
        if name not in best or t < best[name][0]:
            best[name] = (t, b.get("bytes_per_second", 0.0), b.get("kv_size_pct", 100.0))
    if not best:
        die(f"the filter {bench_filter!r} matched no benchmark of {binary}")
    return best, target, far


GOAL_NAMES = ["streaming_read/2"] + [f"decode/{c}/{g}" for c in CASES for g in (1, 4)]


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
    ap.add_argument("--lib", action="append",
                    help="a directory with libkvcal_runtime.so to run the first build's binary against (repeatable)")
    ap.add_argument("--env", action="append", metavar="LABEL:VAR=VALUE[,VAR=VALUE...]",
                    help="a run of the first build's binary with these environment variables, labelled LABEL "
                         "(repeatable)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--reps", type=int, default=6, help="repetitions per run, the fastest kept (default 6)")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the runs (default: every core)")
    ap.add_argument("--layers", type=int,
                    help="copies of the layer the decode cycles through (KVCAL_BENCH_LAYERS; default: enough to fill "
                         "twice the LLC; 1 times a layer the LLC holds)")
    ap.add_argument("--filter", default=FILTER, help="benchmark filter (default: the goals' cases)")
    ap.add_argument("--json", help="write every round's figures and goals here")
    a = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    if a.rounds < 1 or a.reps < 1 or (a.threads is not None and a.threads < 1):
        die("--rounds, --reps and --threads must be at least 1")
    if a.layers is not None and not 1 <= a.layers <= 4096:
        die("--layers must be in [1, 4096]")
    env_runs = [parse_env(spec) for spec in a.env or []]
    builds = a.build or ["build/release"]
    for b in builds:
        if not os.access(os.path.join(b, "bin", "bench_runtime"), os.X_OK):
            die(f"no {b}/bin/bench_runtime (build it first: scripts/build.sh release)")
    env = {"OMP_NUM_THREADS": str(a.threads)} if a.threads else {}
    if a.layers:
        env["KVCAL_BENCH_LAYERS"] = str(a.layers)
    elif os.environ.pop("KVCAL_BENCH_LAYERS", None) is not None:  # run_once passes os.environ on
        print("bench_decode: KVCAL_BENCH_LAYERS in the environment ignored (--layers sets it)", file=sys.stderr)
    # The runs of a round: (label, binary, environment).
    runs = [(b, os.path.join(b, "bin", "bench_runtime"), env) for b in builds]
    for lib in a.lib or []:
        if not any(f.startswith("libkvcal_runtime.so") for f in (os.listdir(lib) if os.path.isdir(lib) else [])):
            die(f"no libkvcal_runtime.so in {lib}")
        runs.append((lib, runs[0][1], {**env, "LD_LIBRARY_PATH": os.path.abspath(lib)}))
    if a.lib:  # the libraries only, each under the one build's binary
        if len(builds) > 1:
            die("--lib takes one --build, whose benchmark binary runs against each library")
        runs = runs[1:]
    for label, extra in env_runs:
        runs.append((label, os.path.join(builds[0], "bin", "bench_runtime"), {**env, **extra}))
    labels = [r[0] for r in runs]
    if len(set(labels)) != len(labels):
        twice = sorted({x for x in labels if labels.count(x) > 1})
        die(f"two runs labelled {', '.join(twice)} (the same build, library or --env label twice)")
    rounds = {label: [] for label in labels}
    targets = {}  # the kernels' SIMD target each run reported
    fars = {}  # and how far ahead its code kernels requested codes (far, near)
    for i in range(a.rounds):
        for label, binary, e in runs:
            print(f"round {i + 1}/{a.rounds}: {label}", file=sys.stderr, flush=True)
            best, targets[label], fars[label] = run_once(binary, e, a.filter, a.reps)
            rounds[label].append(best)
    if len(set(targets.values())) > 1:
        # Intended for forced targets (--env); otherwise a sign that a tree
        # built for timing did not compile the host's best kernels.
        print("bench_decode: the runs used different SIMD targets: "
              + ", ".join(f"{k} {v}" for k, v in targets.items()), file=sys.stderr)
    names = sorted(rounds[labels[0]][0], key=lambda n: (n.startswith("streaming"), n))
    threads = f"{a.threads} thread(s)" if a.threads else "all threads"
    if a.layers:
        threads += f", {a.layers} cop{'y' if a.layers == 1 else 'ies'} of the layer"
    report = {"runs": labels, "rounds": a.rounds, "reps": a.reps, "threads": a.threads, "layers": a.layers,
              "filter": a.filter, "simd_targets": targets,
              "prefetch_far": {k: v[0] for k, v in fars.items()}, "prefetch_near": {k: v[1] for k, v in fars.items()},
              "figures": {}, "goals": {}}
    for label in labels:
        far = f"; far requests: {fars[label][0]}" if fars[label][0] else ""
        far += f"; near requests: {fars[label][1]}" if fars[label][1] else ""
        print(f"\n{label} (kernels: {targets[label]}{far}): fastest of {a.reps}, ms, by round ({threads})")
        for n in names:
            print(f"  {n:28s} " + "  ".join(f"{r[n][0]:8.3f}" for r in rounds[label]))
        report["figures"][label] = {n: [r[n][0] for r in rounds[label]] for n in names}
        if a.threads or a.layers or not all(n in names for n in GOAL_NAMES):
            continue
        print(f"\n{label}: the goals, by round")
        per = [goals(r) for r in rounds[label]]
        report["goals"][label] = []
        for k, (goal, _, _) in enumerate(per[0]):
            figs = [p[k][1] for p in per]
            met = all(p[k][2] for p in per)
            some = any(p[k][2] for p in per)
            verdict = "met" if met else ("met in some rounds" if some else "NOT met")
            print(f"  {goal:62s} " + " / ".join(figs) + f"  -> {verdict}")
            report["goals"][label].append({"goal": goal, "figures": figs, "verdict": verdict})
    if len(labels) >= 2:
        first, second = labels[0], labels[1]
        print(f"\n{first} against {second}: time ratio by round (below 1: the first is faster)")
        worst = 0.0
        for n in names:
            if n.startswith("streaming"):
                continue
            xs = [p[n][0] / q[n][0] for p, q in zip(rounds[first], rounds[second])]
            worst = max(worst, sorted(xs)[len(xs) // 2])
            print(f"  {n:28s} " + " / ".join(f"{x:.2f}" for x in xs))
        if a.build and len(a.build) >= 2 and not a.lib:
            print(f"  largest median ratio {worst:.2f} -> portable within 10% of native: "
                  f"{'met' if worst <= 1.10 else 'NOT met'} (if {first} is the portable build)")
        report["largest_median_ratio"] = worst
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
