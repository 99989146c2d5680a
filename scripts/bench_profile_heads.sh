#!/usr/bin/env bash
# Benchmarks `kvcal profile-heads` against its baselines on one synthetic dump
# of >= 1 GB of attention scores; results in out/bench/profile_heads.json.
#
#  (a) h5py merely reading every prefill and decode dataset, layer by layer
#      (the access pattern of both profilers; float16 as stored, no conversion);
#  (b) the NumPy reference, scripts/profile_heads_reference.py;
#  (c) kvcal profile-heads (default threads: all cores but one; THREADS overrides).
# Each figure is attention-score bytes (total bytes of the prefill and decode
# datasets) per wall-clock second of one fresh process (interpreter start and
# imports included for the Python ones; kvcal's includes the SHA-256 of the dump
# it records in the profile). The dump is read once before timing, so all three
# read a warm file from the page cache (it must fit in RAM).
#
# Builds nothing: uses $KVCAL, else build/release/bin/kvcal (scripts/build.sh release).
# Environment: KVCAL, PYTHON (python3), THREADS (0: kvcal default), REPEAT (1: timed runs of
# each, median reported), BENCH_DUMP (out/bench/heads_dump.h5), PROFILE_OPTS
# (options of both profilers, default "--topk 1024 --pool 5").
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
kvcal=${KVCAL:-build/release/bin/kvcal}
threads=${THREADS:-0}
repeat=${REPEAT:-1}
out=out/bench
dump=${BENCH_DUMP:-$out/heads_dump.h5}
opts=${PROFILE_OPTS:-"--topk 1024 --pool 5"}

if ! "$kvcal" profile-heads --help >/dev/null 2>&1; then
  echo "error: $kvcal is missing or has no profile-heads; build it (scripts/build.sh release) or set KVCAL" >&2
  exit 1
fi
if ! $python -c "import numpy, h5py" 2>/dev/null; then
  $python -m pip install -q numpy h5py
fi
mkdir -p "$out"
# 6 samples x 24 layers x 16 query heads (4 KV heads), N = 4096, T = 64, float16:
# 1.246e9 bytes of attention scores.
if [ ! -f "$dump" ]; then
  echo "== making the synthetic dump $dump"
  $python scripts/make_synthetic_dump.py --layers 24 --q-heads 16 --kv-heads 4 --samples 6 \
    --prompt-len 4096 --steps 64 --dtype float16 --seed 1 --out "$dump"
fi

KVCAL_BIN="$kvcal" THREADS="$threads" REPEAT="$repeat" DUMP="$dump" OUT="$out" OPTS="$opts" $python - <<'EOF'
import json, os, platform, shlex, statistics, subprocess, sys, time
import h5py

kvcal, dump, out = os.environ["KVCAL_BIN"], os.environ["DUMP"], os.environ["OUT"]
threads, repeat, opts = int(os.environ["THREADS"]), int(os.environ["REPEAT"]), shlex.split(os.environ["OPTS"])
load_before = os.getloadavg()

READ_FN = """
def read_all(path):
    import h5py
    with h5py.File(path, "r") as f:
        L = int(f.attrs["num_layers"])
        for name in sorted(f["samples"]):
            g = f["samples"][name]
            pre, dec = g["prefill"], g["decode"]
            for l in range(L):
                pre[l]
                dec[:, l]
"""
READ = READ_FN + "\nimport sys\nread_all(sys.argv[1])\n"  # one fresh process
exec(READ_FN)  # read_all, for the in-process second pass

with h5py.File(dump, "r") as f:
    attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    nbytes, shapes = 0, []
    for name in sorted(f["samples"]):
        g = f["samples"][name]
        nbytes += g["prefill"].nbytes + g["decode"].nbytes
        shapes.append({"sample": name, "prefill": list(g["prefill"].shape), "decode": list(g["decode"].shape),
                       "dtype": str(g["decode"].dtype), "chunks": list(g["decode"].chunks),
                       "compression": g["decode"].compression})

def timed(fn):
    walls = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls), walls

def run(cmd):
    def go():  # one fresh process, its wall time
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"failed: {' '.join(cmd)}\n{r.stderr}")
    return go

print(f"dump {dump}: {nbytes} bytes of attention scores ({nbytes / 1e9:.3f} GB), {os.path.getsize(dump)} on disk; "
      f"{len(shapes)} samples, decode {shapes[0]['decode']} {shapes[0]['dtype']}, chunks {shapes[0]['chunks']}, "
      f"compression {shapes[0]['compression']}")
print(f"load average before: {load_before[0]:.2f} (on {os.cpu_count()} CPUs)")
print("warm-up: h5py reads the whole dump once; all three timings below read a warm file (page cache),")
print("each as one fresh process (interpreter start and imports included for the two Python ones)")
run([sys.executable, "-c", READ, dump])()

ref_out, k_out = os.path.join(out, "heads_ref.h5"), os.path.join(out, "heads_kvcal.h5")
cases = [
    ("h5py read", "read every prefill/decode dataset layer by layer with h5py (no compute)",
     run([sys.executable, "-c", READ, dump])),
    ("NumPy reference", "python3 scripts/profile_heads_reference.py " + " ".join(opts),
     run([sys.executable, "scripts/profile_heads_reference.py", dump, *opts, "--out", ref_out])),
    (f"kvcal {threads} threads", f"kvcal profile-heads {' '.join(opts)} --threads {threads}",
     run([kvcal, "-q", "profile-heads", dump, *opts, "--threads", str(threads), "--out", k_out])),
]
results = []
for name, what, fn in cases:
    wall, walls = timed(fn)
    results.append({"name": name, "what": what, "wall_s": round(wall, 3), "walls_s": [round(w, 3) for w in walls],
                    "bytes_per_s": nbytes / wall})
    print(f"  {name}: {wall:.2f} s", flush=True)

# for information: the same read as a second pass inside this process (no
# start-up or imports, and buffers reused instead of freshly faulted in)
read_all(dump)
t0 = time.perf_counter()
read_all(dump)
hot_read = time.perf_counter() - t0

import numpy as np
with h5py.File(ref_out, "r") as a, h5py.File(k_out, "r") as b:
    diff = {k: float(np.abs(a["heads"][k][()].astype(np.float64) - b["heads"][k][()]).max()) for k in a["heads"]}
agree = all(v <= 1e-6 for v in diff.values())

read, ref, kv = (r["bytes_per_s"] for r in results)
print()
print(f"{'':24} {'wall s':>8} {'MB/s':>10} {'GB/s':>8}")
for r in results:
    print(f"{r['name']:24} {r['wall_s']:8.2f} {r['bytes_per_s'] / 1e6:10.1f} {r['bytes_per_s'] / 1e9:8.3f}")
print(f"kvcal / NumPy reference: {kv / ref:.2f}x   kvcal / h5py read: {kv / read:.3f}x"
      f"   (attention-score bytes per second, warm page cache)")
print(f"for information: h5py read as a second pass inside one process: {hot_read:.2f} s, "
      f"{nbytes / hot_read / 1e9:.2f} GB/s")
print(f"profiles agree (max |diff| <= 1e-6): {agree} {diff}")
report = {
    "benchmark": "profile-heads throughput (attention-score bytes / wall second of one fresh process, warm page cache)",
    "load_average_before": load_before, "load_average_after": os.getloadavg(),
    "dump": {"path": dump, "attention_score_bytes": nbytes, "file_bytes": os.path.getsize(dump),
             "layers": int(attrs["num_layers"]), "q_heads": int(attrs["num_q_heads"]),
             "kv_heads": int(attrs["num_kv_heads"]), "samples": shapes},
    "options": " ".join(opts), "threads": threads, "repeat": repeat,
    "results": results,
    "ratios": {"kvcal_over_numpy": kv / ref, "kvcal_over_h5py_read": kv / read},
    "h5py_read_second_pass_in_process": {"wall_s": round(hot_read, 3), "bytes_per_s": nbytes / hot_read},
    "profiles_agree": agree, "max_abs_diff": diff,
    "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
             "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version,
             "kvcal": subprocess.run([kvcal, "--version"], capture_output=True, text=True).stdout.strip()},
}
with open(os.path.join(out, "profile_heads.json"), "w") as f:
    json.dump(report, f, indent=2)
print(f"wrote {os.path.join(out, 'profile_heads.json')}")
EOF
