#!/usr/bin/env bash
# Configures and builds kvcal. Usage: scripts/build.sh [release|asan] (default release)
# Build trees: build/release, build/asan.
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-release}
case "$kind" in
  # Portable (KVCAL_NATIVE=OFF, also in trees configured before it was the
  # default): scripts/test_emulated.sh runs this build under qemu.
  release) flags=(-DCMAKE_BUILD_TYPE=Release -DKVCAL_NATIVE=OFF) ;;
  asan)    flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCAL_SANITIZE=ON -DKVCAL_BUILD_BENCHMARKS=OFF) ;;
  *) echo "usage: scripts/build.sh [release|asan]" >&2; exit 2 ;;
esac
# The Python tests and scripts use this interpreter (PYTHON overrides).
python=$(command -v "${PYTHON:-python3}")
cmake -S . -B "build/$kind" -G Ninja "${flags[@]}" -DPython3_EXECUTABLE="$python" >/dev/null
cmake --build "build/$kind" -j "$(nproc)"
