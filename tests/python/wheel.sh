#!/usr/bin/env bash
# `pip install .` into a fresh virtualenv, then `import kvcal` and the README's
# example, run from outside the repository. Exits 77 (ctest: skipped) when
# the interpreter has no venv module or PyPI cannot be reached for the build
# requirements. Usage: pip_install.sh PYTHON REPO
set -euo pipefail
python=$1
repo=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! "$python" -m venv "$work/venv" >/dev/null 2>&1; then
  echo "SKIPPED: $python cannot create a virtualenv (python3-venv missing)"
  exit 77
fi
pip=("$work/venv/bin/python" -m pip --disable-pip-version-check -q)
# The build requirements (pip's isolated build would fetch them the same way).
if ! "${pip[@]}" install scikit-build-core nanobind numpy >"$work/req.log" 2>&1; then
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
# Same compiler cache as the main build when one is configured (environment).
"${pip[@]}" install --no-build-isolation "$src" >"$work/install.log" 2>&1 || { tail -40 "$work/install.log" >&2; exit 1; }
cd "$work"
"$work/venv/bin/python" - <<'PY'
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
assert kvcal.__file__.startswith(__import__("sys").prefix), kvcal.__file__  # the installed package
print("kvcal", kvcal.__version__, "installed:", cache.bytes(), "bytes instead of", cache.fp16_bytes())
PY
