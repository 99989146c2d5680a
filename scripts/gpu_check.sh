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
#   scripts/gpu_check.sh test [OUT_DIR]   # GPU machine: build, tests, compute-sanitizer
#   scripts/gpu_check.sh bench [OUT_DIR]  # GPU machine: build, benchmarks (bench_hex_cuda, torch SDPA)
#   scripts/gpu_check.sh run [OUT_DIR]    # test, then bench (results into OUT_DIR, default out/gpu/results)
#   scripts/gpu_check.sh build            # the build step alone (any machine with nvcc)
#   scripts/gpu_check.sh spills           # with nvcc, no GPU needed: registers, stack and
#                                         # spills of each decode kernel (ptxas -v, sm_90 or
#                                         # CUDA_ARCH); spills in the page loop cost more than
#                                         # they save (see the README's GPU section)
#   scripts/gpu_check.sh pack             # with nvcc, no GPU needed: build, then the binaries
#                                         # and the libraries they need into out/gpu/bin
#                                         # (BASE=<commit>: also that commit's benchmark
#                                         # binary, out/gpu/bin/bench_base), and all of it
#                                         # stripped and xz-compressed in out/gpu/bin.txz
#                                         # (a third of the size: what to copy over)
#   scripts/gpu_check.sh device [OUT_DIR] # GPU machine, out/gpu/bin (or out/gpu/bin.txz, unpacked
#                                         # first) carried there: tests,
#                                         # compute-sanitizer, benchmarks (four groups, one
#                                         # JSON each); no build, each step under a time
#                                         # limit (STEP_LIMIT seconds, default 150; half that
#                                         # for sdpa, sanitizers, ncu;
#                                         # NCU_FILTER: a benchmark whose decode ncu profiles);
#                                         # with bench_base there, then HEX-4 decode for it
#                                         # and for this build again (BASE_FILTER;
#                                         # bench_base.json, bench_again.json)
#                                         # RESULTS_TGZ=<file>: the results folder also packed
#                                         # into that one file, for a machine that sends back
#                                         # only a few files
# Every step runs even when an earlier one fails; the exit status is 1 if any
# failed. Environment: CUDA_ARCH (default 90), SANITIZE_FILTER (the tests run
# under compute-sanitizer; default the small shapes), BENCH_FILTER.
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

spills() {
  command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  local o
  o=$(mktemp -d)
  nvcc -O3 -DNDEBUG -std=c++17 -Ilib/src -Ilib/include --generate-code=arch=compute_${CUDA_ARCH:-90},code=sm_${CUDA_ARCH:-90} \
    -Xptxas -v -x cu -c lib/src/runtime/cuda/hex_decode.cu -o "$o/hex_decode.o" 2>"$o/ptxas.txt" ||
    { cat "$o/ptxas.txt" >&2; rm -rf "$o"; return 1; }
  # ptxas prints, per kernel: "Compiling entry function '<mangled>'", then
  # the stack and spills, then the registers.
  awk '/Compiling entry function/ { k = ""; sp = "(no stack line)"; if (match($0, /hex_decode_kernelILi[0-9]+ELi[0-9]+E/)) {
         split(substr($0, RSTART, RLENGTH), a, /ILi|ELi|E/); k = sprintf("hex_decode_kernel<G=%s, mma bits %s>", a[2], a[3]) } }
       k != "" && /spill/ { sp = $0; sub(/^.*: */, "", sp) }
       k != "" && /Used [0-9]+ registers/ { match($0, /Used [0-9]+ registers/); printf "%-36s %s, %s\n", k, substr($0, RSTART, RLENGTH), sp; k = "" }' \
    "$o/ptxas.txt"
  rm -rf "$o"
}

# The benchmark binary of commit $BASE (a worktree in build/gpu-base-src, its
# tree in build/gpu-base), for timings against it in the same device run.
build_base() {
  local src=build/gpu-base-src
  git worktree remove --force "$src" 2>/dev/null || rm -rf "$src"
  git worktree add --detach "$src" "$BASE" >/dev/null
  cmake -S "$src/tests/cuda/standalone" -B build/gpu-base -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix/usr" -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" >/dev/null
  cmake --build build/gpu-base -j "$(nproc)" --target bench_hex_cuda
}

bin=out/gpu/bin
pack() {
  build
  rm -rf "$bin"
  mkdir -p "$bin"
  cp "$tree"/kvcal_cuda_tests "$tree"/bench_hex_cuda "$bin"/
  if [[ -n ${BASE:-} ]]; then
    build_base
    cp build/gpu-base/bench_hex_cuda "$bin"/bench_base
  fi
  # Every library they load but the C and C++ runtimes (the GPU machine's are
  # as new or newer) and the driver's.
  ldd "$bin"/kvcal_cuda_tests "$bin"/bench_hex_cuda | awk '/=> \//{print $3}' | sort -u |
    grep -Ev '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*|libcuda|libstdc\+\+|libgcc_s)\.so' |
    xargs -r cp -L -t "$bin"/
  du -sh "$bin"
  ls "$bin"
  # Host symbols stripped (the device code and line tables are kept), xz.
  local t
  t=$(mktemp -d)
  cp -r "$bin" "$t"/bin
  strip --strip-unneeded "$t"/bin/kvcal_cuda_tests "$t"/bin/bench_hex_cuda "$t"/bin/bench_base 2>/dev/null || true
  tar cf - -C "$t" bin | xz -T0 -6 >out/gpu/bin.txz
  rm -rf "$t"
  ls -l out/gpu/bin.txz
}

status=0
step() {  # runs "$@", records a failure, carries on
  echo "== $*"
  "$@" || { echo "FAILED: $*" >&2; status=1; }
}

prepare() {
  out=${1:-out/gpu/results}
  mkdir -p "$out"
  export LD_LIBRARY_PATH=$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  command -v compute-sanitizer >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  (nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true) | tee "$out/gpu.txt"
}

limit=()  # device mode: a time limit on each step
tests_must_run() {  # the GPU tests, which must run (not skip) here
  "${limit[@]}" "$tree"/kvcal_cuda_tests --gtest_output=xml:"$out/tests.xml" 2>&1 | tee "$out/tests.txt"
  local rc=${PIPESTATUS[0]}
  if grep -q '\[  SKIPPED \]' "$out/tests.txt"; then echo "error: GPU tests skipped on a GPU machine" >&2; return 1; fi
  return "$rc"
}

sanitize() {  # tool
  local filter=${SANITIZE_FILTER:-'*Small*:HeteroCuda.Drift*:HeteroCuda.Gather*:ChessCuda.Batch*:ChessCuda.Kept*'}
  "${limit[@]}" compute-sanitizer --tool "$1" --error-exitcode 1 "$tree"/kvcal_cuda_tests --gtest_filter="$filter" \
    >"$out/$1.txt" 2>&1
  local rc=$?
  tail -5 "$out/$1.txt"
  return $rc
}

test_all() {
  prepare "${1:-}"
  step build
  step tests_must_run
  step "$tree"/kvcal_cuda_emulated_tests --gtest_filter='*Small*'
  step sanitize memcheck
  step sanitize racecheck
}

bench_all() {
  prepare "${1:-}"
  step build
  step "$tree"/bench_hex_cuda --benchmark_filter="${BENCH_FILTER:-.}" --benchmark_out="$out/bench_hex_cuda.json" \
    --benchmark_out_format=json
  step python3 scripts/bench_sdpa.py --out "$out/bench_sdpa.json"
}

device_all() {  # the prebuilt binaries of 'pack'
  if [[ ! -d $bin && -f out/gpu/bin.txz ]]; then tar xf out/gpu/bin.txz -C out/gpu; fi
  out=${1:-out/gpu/results}
  mkdir -p "$out"
  local own=${LD_LIBRARY_PATH:-}  # for torch, which brings its own libraries
  export LD_LIBRARY_PATH=$PWD/$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  command -v compute-sanitizer >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  (nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true) | tee "$out/gpu.txt"
  tree=$bin
  local s=${STEP_LIMIT:-150}
  limit=(timeout -k 5 "$s")
  step tests_must_run
  # The benchmarks in groups, each under the limit with its own JSON, so that
  # one group running long loses only its own figures (BENCH_FILTER: one group).
  local groups=('BM_decode/' 'BM_decode_(tensor_cores|items|groups)' 'BM_chess_hex|BM_compress'
    'BM_chess_s|BM_drift|BM_gather|BM_h2d')
  [[ -n ${BENCH_FILTER:-} ]] && groups=("$BENCH_FILTER")
  local k=0
  for f in "${groups[@]}"; do
    step "${limit[@]}" "$tree"/bench_hex_cuda --benchmark_filter="$f" \
      --benchmark_out="$out/bench_hex_cuda_$k.json" --benchmark_out_format=json
    k=$((k + 1))
  done
  if [[ -x $tree/bench_base ]]; then  # HEX-4 decode, baseline then this build again (interleaved)
    local bf=${BASE_FILTER:-'BM_decode/bits:4/|BM_decode_groups'}
    step "${limit[@]}" "$tree"/bench_base --benchmark_filter="$bf" \
      --benchmark_out="$out/bench_base.json" --benchmark_out_format=json
    step "${limit[@]}" "$tree"/bench_hex_cuda --benchmark_filter="$bf" \
      --benchmark_out="$out/bench_again.json" --benchmark_out_format=json
  fi
  limit=(timeout -k 5 $((s / 2)))
  step "${limit[@]}" env LD_LIBRARY_PATH="$own" python3 scripts/bench_sdpa.py --out "$out/bench_sdpa.json"
  step sanitize memcheck
  step sanitize racecheck
  if [[ -n ${NCU_FILTER:-} ]]; then  # one decode launch under Nsight Compute (speed of light, occupancy)
    command -v ncu >/dev/null || export PATH=/opt/nvidia/nsight-compute/2025.3.1:$PATH
    step "${limit[@]}" ncu --kernel-name regex:hex_decode_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats \
      "$tree"/bench_hex_cuda --benchmark_filter="$NCU_FILTER" --benchmark_min_time=0.01
  fi
  if [[ -n ${RESULTS_TGZ:-} ]]; then
    tar czf "$RESULTS_TGZ" -C "$out" . && echo "results packed into $RESULTS_TGZ"
  fi
}

case "${1:-}" in
  fetch) fetch ;;
  build) build ;;
  spills) spills ;;
  pack) pack ;;
  device) device_all "${2:-}" ;;
  test) test_all "${2:-}" ;;
  bench) bench_all "${2:-}" ;;
  run) test_all "${2:-}"; bench_all "${2:-}" ;;
  *) sed -n '2,25p' "$0" >&2; exit 2 ;;
esac
exit $status
