"""kvcal from Python: expander masks, head profiling, entropy calibration and
the KV-cache runtime, over the same C++ library as the ``kvcal`` CLI.

Arrays cross without copies where the layout allows: inputs are read in place
(NumPy arrays, or torch CPU tensors through DLPack), results are NumPy arrays
that own C++ memory or views into the object that holds them. A wrong dtype is
a ``TypeError``; a wrong shape, stride or a bad value a ``ValueError``; a
missing or unwritable file an ``OSError``; what the library rejects (bad
parameters, corrupt files) a :class:`kvcal.Error` (a ``ValueError``) with the
library's message.

Example::

    import numpy as np, kvcal
    (m,) = kvcal.generate_masks(96, 128, sparsity=1 / 32, method="lift", seed=5)
    cache = kvcal.HexLayerCache(kv_heads=3, head_dim=128, method="hex4",
                                mask=kvcal.Mask(m.rows, m.cols, m.indptr, m.indices))
    k = np.random.default_rng(0).standard_normal((3, 200, 128)).astype(np.float16)
    cache.append(k, k)
    out = cache.attend(np.ones((9, 128), np.float32))
    print(cache.bytes(), "bytes instead of", cache.fp16_bytes())

``kvcal.hf`` (imported on its own: it needs torch and transformers) plugs the
runtime into Hugging Face transformers as a cache.
"""

from ._core import (  # noqa: F401
    Bundle,
    Certificate,
    ChessIndex,
    DriftMonitor,
    DriftStep,
    EntropyCalibration,
    EntropyThresholds,
    Error,
    H2OEvictCache,
    HeadProfile,
    HeadTable,
    HeteroPlan,
    HexLayerCache,
    Mask,
    MaskCache,
    MaskFile,
    MaskRecord,
    ReselectionTrigger,
    Verification,
    __version__,
    calibrate_entropy,
    certify,
    generate_masks,
    make_hetero_plan,
    profile_heads,
    read_head_profile,
    read_masks,
    select_batch,
    verify,
    write_masks,
)

HEX_METHODS = ("fp16",) + tuple(f"{p}{b}" for p in ("kcvt", "h2o", "expander", "hex") for b in (2, 3, 4))
"""Method names HexLayerCache accepts (``h2o-evict`` is H2OEvictCache); any but ``fp16`` may end in ``@int14`` or ``@int8``."""

HEX_DOTS = ("float32", "int14", "int8")
"""Suffixes of a quantizing method: ``@int14`` and ``@int8`` decode with 14-bit and 8-bit integer dot products
(``HexDot::int14``, ``HexDot::int8``)."""


def is_hex_method(name: str) -> bool:
    """Whether :class:`HexLayerCache` accepts ``name``: one of :data:`HEX_METHODS`, optionally ``@int14``/``@int8``/``@float32``
    after any but ``fp16``."""
    base, at, dot = name.partition("@")
    return base in HEX_METHODS and (not at or (base != "fp16" and dot in HEX_DOTS))


__all__ = [n for n in dir() if not n.startswith("_")]
