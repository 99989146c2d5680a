#!/usr/bin/env bash
# Fuzzes kvcal's artifact readers (validate, inspect and every reader) with
# libFuzzer + ASan + UBSan for a bounded time, then reports the executions run
# and the crashes found. Crashing inputs land in out/fuzz/; keep each one in
# fuzz/corpus/ once fixed: ctest replays that folder (fuzz.replay_corpus).
#
# TARGET bundle_open fuzzes the serving path alone: the runtime's
# Bundle::open in process (kvcal_fuzz_bundle, linking kvcal::runtime only),
# seeded with a new sealed bundle, the saved corpus and fuzz/hdf5_crashes/.
# There every crash counts, libhdf5's included: the integrity seal keeps
# damaged files away from libhdf5, so none may happen.
# Usage: scripts/fuzz.sh [SECONDS] [artifacts|bundle_open]   (default 120 artifacts)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-120}
target=${2:-artifacts}
case "$target" in
  artifacts) binary=kvcal_fuzz ;;
  bundle_open) binary=kvcal_fuzz_bundle ;;
  *) echo "usage: scripts/fuzz.sh [SECONDS] [artifacts|bundle_open]" >&2; exit 2 ;;
esac
scripts/setup.sh
for p in clang libclang-rt-14-dev libomp-14-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="${missing:-} $p"
done
if [ -n "${missing:-}" ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi
CC=clang CXX=clang++ cmake -S . -B build/libfuzzer -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCAL_FUZZ=ON \
  -DKVCAL_SANITIZE=ON -DKVCAL_BUILD_TESTS=OFF -DKVCAL_BUILD_BENCHMARKS=OFF -DKVCAL_ENABLE_CUDA=OFF >/dev/null
cmake --build build/libfuzzer --target $binary kvcal_cli -j "$(nproc)"

out=out/fuzz
[ "$target" = artifacts ] || out=out/fuzz_$target
rm -rf "$out" && mkdir -p "$out/corpus" "$out/seeds"
kvcal=build/libfuzzer/bin/kvcal
python=${PYTHON:-python3}
export ASAN_OPTIONS=detect_leaks=0  # libhdf5 keeps caches on error paths; memory errors still abort

# Seeds: one small valid artifact of every kind, plus the saved corpus.
s=$out/seeds
$kvcal -q mask-gen --rows 12 --cols 8 --row-degree 2 --count 2 --out $s/masks.h5 >/dev/null
$kvcal -q mask-gen --method lps --lps-p 3 --lps-q 5 --out $s/lps.h5 >/dev/null
$python scripts/make_synthetic_dump.py --layers 2 --q-heads 4 --kv-heads 2 --samples 1 --prompt-len 24 --steps 4 \
  --dtype float16 --out $s/dump.h5 >/dev/null
$python - "$s/dump.h5" <<'PY'
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "r+") as f:
    for g in f["samples"].values():
        n = int(g.attrs["prompt_len"]) + g["decode"].shape[0]
        g["token_entropy"] = np.linspace(0.5, 3.0, n, dtype=np.float32)
        g["token_varentropy"] = np.linspace(0.1, 2.0, n, dtype=np.float32)
PY
$kvcal -q profile-heads $s/dump.h5 --topk 4 --pool 1 --budget 0.9 --out $s/heads.h5 >/dev/null
$kvcal -q calibrate-entropy $s/dump.h5 --page-size 4 --bins 4 --out $s/entropy.h5 >/dev/null
$kvcal -q bundle --model fuzz --masks $s/masks.h5 --heads $s/heads.h5 --entropy $s/entropy.h5 --out $s/bundle.h5 >/dev/null
cp $s/*.h5 "$out/corpus/"
cp fuzz/corpus/* "$out/corpus/" 2>/dev/null || true
if [ "$target" = bundle_open ]; then
  # Sealed bundles of other shapes, and the inputs that crash libhdf5.
  $kvcal -q bundle --model fuzz2 --masks $s/lps.h5 --heads $s/heads.h5 --entropy $s/entropy.h5 \
    --out "$out/corpus/bundle_lps.h5" >/dev/null
  cp fuzz/hdf5_crashes/* "$out/corpus/"
fi

echo "fuzzing for ${seconds} s from $(ls "$out/corpus" | wc -l) seed inputs"
# Fork mode keeps fuzzing after a crash, so one crash inside libhdf5 does not
# end the run; every crashing input is kept in $out.
set +e
build/libfuzzer/bin/$binary "$out/corpus" -fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 \
  -max_total_time="$seconds" -max_len=131072 -timeout=20 -rss_limit_mb=4096 \
  -artifact_prefix="$out/" >"$out/log" 2>&1
set -e
execs=$(grep -oE "^#[0-9]+" "$out/log" | tail -1 | tr -d '#' || true)
# Classify each crash by where it happened: inside libhdf5, or in kvcal.
ours=0 hdf5=0
for c in $(ls "$out" | grep -E "^(crash|leak|timeout|oom)-" || true); do
  frame=$(build/libfuzzer/bin/$binary "$out/$c" 2>&1 | grep -E "^ +#[0-9]+ |runtime error" |
    grep -v -E "interceptor|libc[.]so|sysdeps|asan|ubsan|sanitizer|fuzzer::|in malloc|in strdup|operator new" | head -1 || true)
  [ -n "$frame" ] || { echo "  $c: does not reproduce on its own"; continue; }
  if echo "$frame" | grep -q "libhdf5"; then
    hdf5=$((hdf5 + 1)); echo "  $c: inside libhdf5: $(echo "$frame" | grep -oE "in [A-Za-z0-9_]+" | head -1)"
  else
    ours=$((ours + 1)); echo "  $c: in kvcal: $frame"
  fi
done
if [ "$target" = bundle_open ]; then
  # In process nothing contains a crash: each one counts.
  echo "executions: ${execs:-?}; crashes in the in-process Bundle::open path: $((ours + hdf5)) ($hdf5 inside libhdf5) (log: $out/log)"
  [ $((ours + hdf5)) -eq 0 ]
else
  echo "executions: ${execs:-?}; crashes in kvcal code: $ours; crashes inside libhdf5 (contained by the CLI's child process): $hdf5 (log: $out/log)"
  [ "$ours" -eq 0 ]
fi
