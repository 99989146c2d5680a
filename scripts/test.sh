#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test through ctest:
# first the Release build (then its SIMD kernel tests under valgrind and the
# runtime under qemu), then the same tests under AddressSanitizer and
# UndefinedBehaviorSanitizer, then the runtime's threaded tests under
# ThreadSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
jobs=$(nproc)

scripts/build.sh release
ctest --test-dir build/release --output-on-failure -j "$jobs"

# The decode kernels' registers and spills as ptxas reports them (no GPU
# needed), where nvcc is: printed for the log, not a pass/fail check (on an
# H100, changes that made the page loop spill were 6-12% slower).
if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then scripts/gpu_check.sh spills; fi

# The SIMD kernels under valgrind's memcheck, on every target the emulated
# CPU offers (valgrind hides AVX-512): this covers the row-unrolled kernels,
# which the sanitizer builds below leave out (see kernels_cpu.cpp).
valgrind -q --error-exitcode=9 build/release/tests/kvcal_kernel_tests --gtest_brief=1

# The runtime under emulation: x86-64 without AVX and aarch64 (qemu-user).
scripts/test_emulated.sh build/release

# (The sanitizer build compiles the kernels for AVX2, AVX-512 and the scalar
# baseline; their SSSE3 and SSE4 targets ran under valgrind and qemu above.)
scripts/build.sh asan
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:strict_string_checks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir build/asan --output-on-failure -j "$jobs"

# Concurrency under ThreadSanitizer: the runtime's mask cache (its threaded
# tests) and the CUDA kernels under the host emulation of CUDA, where a
# missing barrier between threads of a block is a reported race. (CHESS: the
# kept-selection test runs every CHESS kernel; the batch test, the same
# kernels over more data, runs in the other builds.)
cmake -S . -B build/tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCAL_SANITIZE_THREAD=ON \
  -DKVCAL_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build/tsan -j "$jobs" --target kvcal_runtime_tests kvcal_cuda_emulated_tests
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
  ctest --test-dir build/tsan -R '^runtime\.(MaskCache|HexCudaEmulated\.SmallFlowForRaceChecks|HeteroCudaEmulated\.(DriftMonitors|Gather)|ChessCudaEmulated\.(Kept|HexDecode))' --output-on-failure -j "$jobs"
