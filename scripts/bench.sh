#!/usr/bin/env bash
# Runs every benchmark and its baselines in one go; results in out/bench/.
#  (a) 96x128, rho = 1/32: masks generated and exactly certified per second, one core.
#  (b) 32768x4096, rho = 1/32: one mask with an exact certificate, wall time on
#      all cores, and peak memory (each case in its own process).
# Baselines in the same run: a dense eigensolver in C++ (in bench_masks) and
# the SciPy pipeline (lift + svds, dense eigvalsh), installed here with pip.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh release
out=out/bench
mkdir -p "$out"
bench=build/release/bin/bench_masks
python=${PYTHON:-python3}

echo "== (a) 96x128, d1 = 4, d2 = 3, one core"
$bench --benchmark_filter='a_' --benchmark_out="$out/a.json" --benchmark_out_format=json
for case in b_32768x4096_lift_2cores b_32768x4096_random_2cores b_32768x4096_lift_baseline_dense_eigen; do
  echo "== (b) $case"
  $bench --benchmark_filter="$case" --benchmark_out="$out/$case.json" --benchmark_out_format=json
done
echo "== LPS X^{13,61}: build, build + certificate, and a random mask of the same shape"
$bench --benchmark_filter='lps_' --benchmark_out="$out/lps.json" --benchmark_out_format=json
echo "== (b) as a user runs it: kvcal mask-gen + exact certificate, wall time and peak memory"
/usr/bin/time -f "kvcal mask-gen 32768x4096 lift: %e s wall, %M KiB peak" \
  build/release/bin/kvcal mask-gen --rows 32768 --cols 4096 --row-degree 128 --method lift --seed 1 --tries 8 \
  --out "$out/b_lift.h5"

echo "== baseline: SciPy lift + svds and dense eigvalsh"
if ! $python -c "import numpy, scipy, h5py" 2>/dev/null; then
  $python -m pip install -q numpy scipy h5py
fi
$python scripts/bench_baseline_scipy.py 32768 4096 128 | tee "$out/scipy_b.jsonl"
$python scripts/bench_baseline_scipy.py 96 128 4 --no-dense | tee "$out/scipy_a.jsonl"
echo "== profile-heads on a synthetic dump of >= 1 GB against the NumPy reference and a plain h5py read"
KVCAL=build/release/bin/kvcal PYTHON=$python bash scripts/bench_profile_heads.sh
echo "== token entropy/varentropy, V = 128,256, against NumPy and the memory-read bandwidth"
$python scripts/bench_entropy.py --bench build/release/bin/bench_entropy
echo "== runtime: HEX block compression, decode over a 32K-token cache (fp16 and compressed), memory-read bandwidth"
build/release/bin/bench_runtime --benchmark_out="$out/runtime.json" --benchmark_out_format=json
echo "== runtime: the decode goals (HEX against fp16 and the streaming read), 3 interleaved rounds"
$python scripts/bench_decode.py --build build/release --json "$out/decode_goals.json"
echo "== runtime: the decode kernels alone (float32, int14, int8), one thread, one block in cache"
build/release/bin/bench_kernels --benchmark_out="$out/kernels.json" --benchmark_out_format=json
echo "== runtime: CHESS selection per decode step vs one layer's fp16 attention (x 32 layers = one decode step)"
build/release/bin/bench_chess --benchmark_out="$out/chess.json" --benchmark_out_format=json
echo "== bundle seal: its cost at open for a sealed 1 GiB file against a raw read of the same file"
build/release/bin/bench_seal --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
  --benchmark_out="$out/seal.json" --benchmark_out_format=json
echo "Results in $out/"
