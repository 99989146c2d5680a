#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test through ctest:
# first the Release build, then the same tests under AddressSanitizer and
# UndefinedBehaviorSanitizer, then the runtime's mask cache tests under
# ThreadSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
jobs=$(nproc)

scripts/build.sh release
ctest --test-dir build/release --output-on-failure -j "$jobs"

# The runtime under emulation: x86-64 without AVX and aarch64 (qemu-user).
scripts/test_emulated.sh build/release

scripts/build.sh asan
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:strict_string_checks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir build/asan --output-on-failure -j "$jobs"

# The mask cache's concurrency under ThreadSanitizer: only the runtime's test
# binary is built, and only its MaskCache tests run (they are the threaded ones).
cmake -S . -B build/tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCAL_SANITIZE_THREAD=ON \
  -DKVCAL_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build/tsan -j "$jobs" --target kvcal_runtime_tests
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
  ctest --test-dir build/tsan -R '^runtime\.MaskCache' --output-on-failure -j "$jobs"
