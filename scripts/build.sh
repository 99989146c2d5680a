#!/usr/bin/env bash
# Configures and builds kvcal. Usage: scripts/build.sh [release|asan] (default release)
# Build trees: build/release, build/asan.
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-release}
case "$kind" in
  release) flags=(-DCMAKE_BUILD_TYPE=Release) ;;
  asan)    flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCAL_SANITIZE=ON -DKVCAL_BUILD_BENCHMARKS=OFF) ;;
  *) echo "usage: scripts/build.sh [release|asan]" >&2; exit 2 ;;
esac
# The Python tests and scripts use this interpreter (PYTHON overrides).
python=$(command -v "${PYTHON:-python3}")
cmake -S . -B "build/$kind" -G Ninja "${flags[@]}" -DPython3_EXECUTABLE="$python" >/dev/null
cmake --build "build/$kind" -j "$(nproc)"
