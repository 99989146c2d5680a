#!/usr/bin/env bash
# Installs kvcal from BUILD_DIR into a temporary prefix, builds the consumer
# with find_package(kvcal) against it, and runs it.
# Usage: run.sh BUILD_DIR CONSUMER_SOURCE_DIR
set -euo pipefail
build=$1 src=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/kvcal_consumer.XXXXXX")
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
test -x "$work/prefix/bin/kvcal" || { echo "kvcal binary not installed"; exit 1; }
test -f "$work/prefix/include/kvcal/io/masks.h" || { echo "headers not installed"; exit 1; }
ls "$work"/prefix/lib*/cmake/kvcal/kvcalConfigVersion.cmake >/dev/null
"$work/prefix/bin/kvcal" --version
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/consumer" "$work/mask.h5"
"$work/prefix/bin/kvcal" mask-certify "$work/mask.h5" | tail -1
test -f "$work/prefix/include/kvcal/runtime/hex.h" || { echo "runtime headers not installed"; exit 1; }
"$work/build/engine"
if [[ -x "$work/build/engine_cuda" ]]; then "$work/build/engine_cuda"; fi
