#!/usr/bin/env bash
# Installs the Debian packages kvcal builds with, when any is missing.
# Usage: scripts/setup.sh
set -euo pipefail

packages=(build-essential cmake ninja-build pkg-config
          libeigen3-dev libspectra-dev libboost-graph-dev libhdf5-dev hdf5-tools
          libcli11-dev libfmt-dev libgtest-dev libbenchmark-dev time bc)

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
