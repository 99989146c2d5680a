#!/usr/bin/env bash
# Benchmarks `kvcal profile-heads` under MPI on a synthetic dump in several
# files: the single process (no launcher: the same code as the build without
# MPI) beside `mpirun -n 1` and `mpirun -n 2`, each REPEAT times (median
# reported), with rank 0's per-rank time table (-v) of the last run of each.
# Every output must equal the single process's (datasets compared with h5py).
#
# Usage: scripts/bench_mpi.sh [DIR]   (default DIR: /tmp/kvcal_bench_mpi)
# DIR holds the dump files part*.h5; missing ones are generated (4 files of
# 3 samples, 24 layers, 16/4 heads, N = 4096/3000/5000, T = 64/48/80, float16:
# 2.5 GB of scores). The files are read once before timing (warm page cache).
# Environment: KVCAL (build/release/bin/kvcal), PYTHON (python3), REPEAT (3),
# PROFILE_OPTS ("--topk 1024 --pool 5"), KEEP=1 keeps generated files
# (default: DIR is removed at the end if this script created it).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
kvcal=$(realpath "${KVCAL:-build/release/bin/kvcal}")
python=${PYTHON:-python3}
repeat=${REPEAT:-3}
opts=${PROFILE_OPTS:-"--topk 1024 --pool 5"}
dir=${1:-/tmp/kvcal_bench_mpi}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

"$kvcal" --version | grep -q "MPI (" || { echo "error: $kvcal is built without MPI" >&2; exit 1; }
created=0
if [ ! -d "$dir" ]; then mkdir -p "$dir"; created=1; fi
for i in 0 1 2 3; do
  f="$dir/part$i.h5"
  [ -f "$f" ] && continue
  echo "== making $f" >&2
  "$python" "$root/scripts/make_synthetic_dump.py" --layers 24 --q-heads 16 --kv-heads 4 --samples 3 \
    --prompt-len 4096,3000,5000 --steps 64,48,80 --dtype float16 --seed $((i + 1)) --out "$f" >/dev/null
done
files=("$dir"/part*.h5)
cat "${files[@]}" >/dev/null  # warm the page cache
bytes=$("$python" - "${files[@]}" <<'EOF'
import sys, h5py
n = 0
for p in sys.argv[1:]:
    with h5py.File(p) as f:
        for g in f["samples"].values():
            n += g["prefill"].nbytes + g["decode"].nbytes
print(n)
EOF
)
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)  cores: $(nproc)  scores: $bytes bytes in ${#files[@]} files"

run_case() {  # name, then the command prefix (empty: no launcher)
  local name=$1
  shift
  local times=() t0 t1 log="$dir/$name.log"
  for _ in $(seq "$repeat"); do
    rm -f "$dir/$name.h5"
    t0=$(date +%s.%N)
    "$@" "$kvcal" -v profile-heads "${files[@]}" $opts --out "$dir/$name.h5" >/dev/null 2>"$log"
    t1=$(date +%s.%N)
    times+=("$(echo "$t1 - $t0" | bc)")
  done
  local med
  med=$(printf '%s\n' "${times[@]}" | sort -g | sed -n "$(((repeat + 1) / 2))p")
  printf '%-12s median %6.2f s  (%s)  %5.2f GB/s of scores\n' "$name" "$med" "${times[*]}" \
    "$(echo "$bytes / $med / 1000000000" | bc -l)"
  grep -E "^ *(rank|[0-9]+ ) |^time:" "$log" | sed 's/^/    /' || true
  echo "$med" >"$dir/$name.median"
}

run_case serial env -u OMPI_COMM_WORLD_SIZE
# --bind-to none: Open MPI binds each rank to one core when np <= 2, which
# would put a rank's reader, hashing and compute threads on a single core.
run_case mpirun_n1 mpirun -q --bind-to none -n 1
run_case mpirun_n2 mpirun -q --bind-to none -n 2
s=$(cat "$dir/serial.median") m1=$(cat "$dir/mpirun_n1.median") m2=$(cat "$dir/mpirun_n2.median")
printf 'speedup 2 vs 1 rank: %.2fx (parallel efficiency %.0f%%); mpirun -n 1 vs single process: %.2fx\n' \
  "$(echo "$m1 / $m2" | bc -l)" "$(echo "50 * $m1 / $m2" | bc -l)" "$(echo "$s / $m1" | bc -l)"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

"$python" - "$dir/serial.h5" "$dir/mpirun_n1.h5" "$dir/mpirun_n2.h5" <<'EOF'
import sys, h5py
def ds(p):
    out = {}
    with h5py.File(p) as f:
        f.visititems(lambda n, o: out.__setitem__(n, o[()].tobytes()) if isinstance(o, h5py.Dataset) else None)
    return out
ref = ds(sys.argv[1])
for p in sys.argv[2:]:
    assert ds(p) == ref, f"{p} differs from {sys.argv[1]}"
print("outputs: datasets byte-identical to the single process")
EOF
if [ "$created" = 1 ] && [ "${KEEP:-0}" != 1 ]; then rm -rf "$dir"; fi
