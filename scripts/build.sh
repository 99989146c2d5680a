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
# A compiler cache where one is installed (scripts/setup.sh installs ccache):
# rebuilds of unchanged sources, in any clone of the repository, are cache hits.
if command -v ccache >/dev/null && [ -z "${CMAKE_CXX_COMPILER_LAUNCHER:-}" ]; then
  export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1 CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache \
         CMAKE_CUDA_COMPILER_LAUNCHER=ccache
fi
cmake -S . -B "build/$kind" -G Ninja "${flags[@]}" -DPython3_EXECUTABLE="$python" >/dev/null
cmake --build "build/$kind" -j "$(nproc)"
