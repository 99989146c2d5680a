#!/usr/bin/env bash
# Installs what kvcal builds and tests with, when missing: Debian packages
# (Open MPI among them, for the MPI build and its tests), and NumPy, h5py and
# matplotlib for the Python scripts.
# Usage: scripts/setup.sh
set -euo pipefail

packages=(build-essential cmake ninja-build pkg-config
          libeigen3-dev libspectra-dev libboost-graph-dev libhdf5-dev hdf5-tools
          libcli11-dev libfmt-dev libgtest-dev libbenchmark-dev time bc
          libasan8 libubsan1 libtsan2
          libopenmpi-dev openmpi-bin)

# Python packages for the scripts and their tests (NumPy, h5py, matplotlib),
# installed for the interpreter the build uses (PYTHON, default python3).
python=${PYTHON:-python3}
if ! "$python" -c "import numpy, h5py, matplotlib" 2>/dev/null; then
  echo "setup: installing numpy h5py matplotlib for $python" >&2
  "$python" -m pip install -q --disable-pip-version-check numpy h5py matplotlib
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
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
