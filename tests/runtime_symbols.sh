#!/usr/bin/env bash
# ABI check: libkvcal_runtime.so exports kvcal::runtime's symbols and nothing
# of its dependencies (Highway's per-target kernels, HDF5, fmt, Eigen, Boost,
# kvcal's static library). What else the dynamic symbol table holds are the
# standard library's weak template instantiations (std::, __gnu_cxx::) and
# OpenMP's named critical sections, which every C++ shared library exports.
# Usage: runtime_symbols.sh LIBRARY
set -euo pipefail
lib=$1
syms=$(nm -D --defined-only -C "$lib" | sed -E 's/^[0-9a-f]+ [A-Za-z] //')
[[ -n $syms ]] || { echo "FAIL: no exported symbols in $lib"; exit 1; }
bad=$(echo "$syms" | grep -vE '^(kvcal::runtime::|typeinfo (name )?for kvcal::runtime::|vtable for kvcal::runtime::)' |
  grep -vE '^(std::|__gnu_cxx::|typeinfo (name )?for std::|vtable for std::|\.gomp_critical_user_|_init$|_fini$)' |
  grep -vE '^(void |bool |char |long |unsigned |int |float |double )?std::' || true)
if [[ -n $bad ]]; then
  echo "FAIL: $lib exports symbols that are not kvcal::runtime's:"
  echo "$bad" | head -20
  exit 1
fi
n=$(echo "$syms" | grep -c 'kvcal::runtime::')
echo "ok: $n kvcal::runtime symbols, nothing of Highway, HDF5, fmt, Eigen or Boost"
