#!/usr/bin/env bash
# The runtime on CPUs this machine is not, under qemu user-mode emulation:
#  1. x86-64 without AVX (qemu-x86_64 -cpu Westmere: SSE4.2 only): the portable
#     release build's kernel tests and the runtime's whole test suite. No
#     illegal instruction, the same results, the SSE4 kernels chosen.
#  2. aarch64 (Debian's cross compiler, libhwy-dev:arm64, libgtest-dev:arm64;
#     qemu-aarch64's default CPU has NEON, SVE and SVE2): the kernel tests
#     (kernels and fp16 conversions on every Arm target against the
#     references), cross-compiled from their sources.
# Usage: scripts/test_emulated.sh [RELEASE_BUILD_DIR]  (default build/release;
# it must be a portable build, KVCAL_NATIVE=OFF, the default).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
if grep -q '^KVCAL_NATIVE:BOOL=ON' "$build/CMakeCache.txt" 2>/dev/null; then
  echo "test_emulated: $build is a -march=native build; emulation needs a portable one" >&2
  exit 2
fi
cmake --build "$build" -j "$(nproc)" --target kvcal_kernel_tests kvcal_runtime_tests kvcal_cli

echo "== x86-64 without AVX (qemu-x86_64 -cpu Westmere)"
out=$(qemu-x86_64 -cpu Westmere "$build/tests/kvcal_kernel_tests" 2>&1) || { echo "$out"; exit 1; }
echo "$out" | grep -E 'SIMD targets|PASSED|FAILED'
# The emulated CPU must really lack AVX: the best target is SSE4.
echo "$out" | grep -q 'SIMD targets tested on this CPU: SSE4 ' || { echo "test_emulated: expected SSE4 as the best target" >&2; exit 1; }
(cd "$build/tests" && qemu-x86_64 -cpu Westmere ./kvcal_runtime_tests --gtest_brief=1)
# The CLI names the kernels the same binary picks on this CPU.
version=$(qemu-x86_64 -cpu Westmere "$build/bin/kvcal" --version)
echo "$version"
[[ $version == *"CPU kernels: SSE4)" ]] || { echo "test_emulated: kvcal --version should name SSE4" >&2; exit 1; }

echo "== aarch64 (qemu-aarch64)"
mkdir -p build/aarch64
aarch64-linux-gnu-g++ -std=c++20 -O2 -Ilib/include -Ilib/src \
  tests/unit/runtime/test_kernels.cpp lib/src/runtime/hex/kernels_cpu.cpp lib/src/runtime/hex/scores_int_cpu.cpp \
  lib/src/runtime/hex/values_int_cpu.cpp lib/src/runtime/hex/entries_cpu.cpp lib/src/runtime/hex/prefetch.cpp lib/src/core/half.cpp \
  -lhwy -lgtest_main -lgtest -pthread -o build/aarch64/kvcal_kernel_tests
out=$(qemu-aarch64 -L /usr/aarch64-linux-gnu build/aarch64/kvcal_kernel_tests 2>&1) || { echo "$out"; exit 1; }
echo "$out" | grep -E 'SIMD targets|PASSED|FAILED'
echo "$out" | grep -q 'SIMD targets tested on this CPU: .*NEON' || { echo "test_emulated: NEON was not tested" >&2; exit 1; }
