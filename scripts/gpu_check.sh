#!/usr/bin/env bash
# HEX on the GPU: build, tests (also under compute-sanitizer memcheck and
# racecheck) and benchmarks, on a GPU machine that has the CUDA toolkit,
# CMake, ninja and python3 (with torch for the fp16 baseline) but none of
# kvcal's Debian -dev packages. It builds tests/cuda/standalone, the HEX
# runtime alone, against Highway, GoogleTest and Google Benchmark unpacked
# from .deb files fetched beforehand on a machine with apt.
#
# Usage:
#   scripts/gpu_check.sh fetch            # with apt: the .debs into out/gpu/debs
#   scripts/gpu_check.sh run [OUT_DIR]    # on the GPU machine (results into OUT_DIR, default out/gpu/results)
#   scripts/gpu_check.sh build            # the build step alone (any machine with nvcc)
# Environment: CUDA_ARCH (default 90), SANITIZE_FILTER (the tests run under
# compute-sanitizer; default the small flow shapes), BENCH_FILTER.
set -euo pipefail
cd "$(dirname "$0")/.."
debs=out/gpu/debs
prefix=$PWD/build/gpu-prefix
tree=build/gpu

fetch() {
  mkdir -p "$debs"
  (cd "$debs" && apt-get download libhwy-dev libhwy1 libgtest-dev libbenchmark-dev libbenchmark1debian)
  ls -l "$debs"
}

build() {
  command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  ls "$debs"/*.deb >/dev/null 2>&1 || { echo "error: no .deb files in $debs (run '$0 fetch' where apt works)" >&2; exit 2; }
  rm -rf "$prefix"
  mkdir -p "$prefix"
  for d in "$debs"/*.deb; do dpkg -x "$d" "$prefix"; done
  cmake -S tests/cuda/standalone -B "$tree" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix/usr" -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" >/dev/null
  cmake --build "$tree" -j "$(nproc)"
}

run() {
  local out=${1:-out/gpu/results}
  mkdir -p "$out"
  build
  export LD_LIBRARY_PATH=$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$out/gpu.txt"
  # The tests must run, not skip, here.
  "$tree"/kvcal_cuda_tests 2>&1 | tee "$out/tests.txt"
  if grep -q '\[  SKIPPED \]' "$out/tests.txt"; then echo "error: GPU tests skipped on a GPU machine" >&2; exit 1; fi
  "$tree"/kvcal_cuda_emulated_tests --gtest_filter='*Small*' | tail -3
  local filter=${SANITIZE_FILTER:-HexCuda.FlowMatchesTheHostExecutor}
  compute-sanitizer --tool memcheck --error-exitcode 1 "$tree"/kvcal_cuda_tests --gtest_filter="$filter" \
    2>&1 | tail -5 | tee "$out/memcheck.txt"
  compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 1 "$tree"/kvcal_cuda_tests \
    --gtest_filter="$filter" 2>&1 | tail -5 | tee "$out/racecheck.txt"
  "$tree"/bench_hex_cuda --benchmark_filter="${BENCH_FILTER:-.}" --benchmark_out="$out/bench_hex_cuda.json" \
    --benchmark_out_format=json 2>&1 | tee "$out/bench_hex_cuda.txt"
  python3 scripts/bench_sdpa.py --out "$out/bench_sdpa.json" 2>&1 | tee "$out/bench_sdpa.txt"
}

case "${1:-}" in
  fetch) fetch ;;
  build) build ;;
  run) run "${2:-}" ;;
  *) sed -n '2,16p' "$0" >&2; exit 2 ;;
esac
