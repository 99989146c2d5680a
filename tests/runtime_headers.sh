#!/usr/bin/env bash
# The runtime's public headers stand alone, are C++17 and include the standard library
# only: no HDF5, Boost, CLI11, fmt or Eigen header, directly or indirectly.
# Usage: runtime_headers.sh CXX INCLUDE_DIR
set -euo pipefail
cxx=$1 inc=$2
status=0
for h in "$inc"/kvcal/runtime/*.h; do
  deps=$(echo "#include \"${h#"$inc"/}\"" | "$cxx" -std=c++17 -I"$inc" -x c++ -M - 2>&1) || {
    echo "FAIL: $h does not compile on its own:"; echo "$deps"; status=1; continue; }
  if bad=$(echo "$deps" | tr ' \\' '\n\n' | grep -Ei 'hdf5|/H5|boost|/CLI/|/fmt/|eigen3' | sort -u) && [[ -n $bad ]]; then
    echo "FAIL: $h pulls in: $bad"; status=1
  else
    echo "ok: ${h#"$inc"/}"
  fi
done
exit $status
