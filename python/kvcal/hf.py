"""kvcal in Hugging Face transformers: a KV cache whose every layer is a kvcal
runtime cache.

    import kvcal.hf
    cache = kvcal.hf.KvcalCache(model.config, method="hex3", bundle="m.kvcal.h5")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32, do_sample=False)
    print(cache.bytes(), "bytes stored instead of", cache.fp16_bytes())

Methods: ``fp16``, ``kcvtB``, ``h2oB``, ``expanderB``, ``hexB`` (B = 2, 3, 4 bits;
:class:`kvcal.HexLayerCache`) and ``h2o-evict`` (:class:`kvcal.H2OEvictCache`).
Expander masks come from the bundle when it holds the shape (block x head_dim
at the sparsity), else they are generated and certified on the fly by a
:class:`kvcal.MaskCache`.

How it runs (CPU, batch 1, full-attention decoder models such as Llama):

- The cache registers an attention implementation named ``"kvcal"`` with
  transformers and sets ``config._attn_implementation = "kvcal"`` on the
  config it is given (the model's own config, so the model uses it). Under a
  cache that is not a KvcalCache it is exactly the model's eager attention, so
  a DynamicCache run through the same model is unchanged.
- Prefill: the prompt attends to itself in full precision with the model's
  eager attention (as kvcal eval-fidelity replays it); its attention weights,
  summed over query heads and rows, become the heavy-hitter scores (HEX §3.3;
  H2O: per query head), and then the prompt's keys and values go into the
  runtime cache as float16.
- Decode: each new token is appended to the runtime cache, and the token's
  attention is the runtime's own (``attend``: on the compressed blocks' codes,
  the fp16 kept rows and the fp16 residual); the weights it returns are
  observed for the heavy hitters.

What differs from the C++ runtime driven by recorded data: nothing in the
caches; the heavy-hitter scores come from the live model's weights (the
compressed cache's own during decode) rather than from a recording. Not
supported: batches > 1, several new tokens per step after the prompt
(assisted or chunked decoding), sliding-window layers, device tensors. The
CHESS (page selection) and HeteroCache (per-head budgets) methods are not
offered as caches: CHESS selects pages from the keys of every layer of a token,
which transformers hands to a cache one layer at a time, and HeteroCache's
satellites fetch evicted tokens back from host memory; use kvcal.ChessIndex /
kvcal.make_hetero_plan with recorded data (kvcal eval-fidelity) for those.
"""

from __future__ import annotations

import math
import threading

import numpy as np

import kvcal

SUPPORTED_TRANSFORMERS = ((5, 0), (6, 0))  # [min, max)
"""transformers versions whose Cache / CacheLayerMixin API this module follows."""


def _check_versions():
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as e:  # pragma: no cover - the message is the point
        raise ImportError(
            f"kvcal.hf needs torch and transformers ({e}); install them with "
            "`pip install torch 'transformers>=5,<6'` (or `pip install kvcal[hf]`)"
        ) from e
    parts = []
    for p in transformers.__version__.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    version = tuple(parts)
    lo, hi = SUPPORTED_TRANSFORMERS
    if not (lo <= version < hi):
        raise ImportError(
            f"kvcal.hf supports transformers >= {lo[0]}.{lo[1]} and < {hi[0]}.{hi[1]} (its Cache/CacheLayerMixin "
            f"API); found transformers {transformers.__version__}"
        )


_check_versions()

import torch  # noqa: E402
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

ATTENTION_NAME = "kvcal"

# The layer whose update() ran last on this thread and whose attention is due:
# update() and the attention function run back to back in one attention forward.
_pending = threading.local()


def _model_eager(module):
    """The model's own eager attention function (the one its modeling file defines)."""
    import sys

    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise NotImplementedError(
            f"kvcal.hf: {type(module).__name__} has no eager_attention_forward in its modeling file; "
            "only models with eager attention (e.g. Llama) are supported"
        )
    return fn


def _to_half_numpy(t: torch.Tensor) -> np.ndarray:
    """[1, H, n, D] torch -> float16 [H, n, D] NumPy, sharing memory when already float16 and contiguous."""
    return t[0].detach().to(torch.float16).contiguous().numpy()


class KvcalLayer(CacheLayerMixin):
    """One decoder layer's K/V in a kvcal runtime cache (see the module docstring)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "KvcalCache", layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.runtime = None  # kvcal.HexLayerCache or kvcal.H2OEvictCache, made at the first update
        self.tokens = 0
        self._prompt = None  # (k, v) of the prompt until its attention was observed

    def lazy_initialization(self, key_states, value_states):
        if key_states.device.type != "cpu":
            raise ValueError(f"kvcal.hf runs on CPU; the model's keys are on {key_states.device}")
        if key_states.shape[0] != 1:
            raise ValueError(f"kvcal.hf supports batch size 1, got {key_states.shape[0]}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.runtime = self.owner._make_runtime(key_states.shape[1], key_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if getattr(_pending, "layer", None) is not None:
            stale, _pending.layer = _pending.layer, None
            raise RuntimeError(
                f"kvcal.hf: layer {stale.layer_idx}'s attention did not run through the '{ATTENTION_NAME}' attention "
                "implementation; keep config._attn_implementation as KvcalCache set it"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise ValueError(f"kvcal.hf supports batch size 1, got {key_states.shape[0]}")
        n = key_states.shape[-2]
        if self.tokens == 0:
            # The prompt attends in full precision; it enters the runtime once its weights are observed.
            self._prompt = (key_states, value_states)
        else:
            if n != 1:
                raise NotImplementedError(
                    f"kvcal.hf decodes one token per step after the prompt; got {n} (assisted or chunked decoding)"
                )
            self.runtime.append(_to_half_numpy(key_states), _to_half_numpy(value_states))
        self.tokens += n
        _pending.layer = self
        return key_states, value_states

    def attention(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """The attention of this layer's pending step (called by the registered attention function)."""
        if self._prompt is not None:
            out, weights = _model_eager(module)(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
            w = weights[0].detach().float()  # [Hq, N, N]
            if isinstance(self.runtime, kvcal.H2OEvictCache):
                self.runtime.observe(w.sum(dim=1).contiguous().numpy())
            else:
                self.runtime.observe(w.reshape(-1, w.shape[-1]).contiguous().numpy())
            k, v = self._prompt
            self._prompt = None
            self.runtime.append(_to_half_numpy(k), _to_half_numpy(v))
            return out, weights
        q = query[0, :, 0, :].detach().float().contiguous().numpy()  # [Hq, D]
        out, probs = self.runtime.attend(q, scale=float(scaling), return_probs=True)
        self.runtime.observe(probs)
        out_t = torch.from_numpy(out).to(query.dtype).reshape(1, 1, q.shape[0], q.shape[1])
        return out_t, torch.from_numpy(probs).to(query.dtype)[None, :, None, :]

    def get_mask_sizes(self, query_length: int):
        return self.tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self):
        self.runtime = None
        self.tokens = 0
        self._prompt = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("kvcal.hf does not support beam search (batch size 1)")

    def bytes(self) -> int:
        return self.runtime.bytes() if self.runtime is not None else 0

    def fp16_bytes(self) -> int:
        return self.runtime.fp16_bytes() if self.runtime is not None else 0


def _kvcal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    layer = getattr(_pending, "layer", None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if layer is None or layer.layer_idx != getattr(module, "layer_idx", None):
        # Not a KvcalCache step (e.g. a DynamicCache through the same model): plain eager attention.
        return _model_eager(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    _pending.layer = None
    return layer.attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


ALL_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, _kvcal_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, eager_mask)


class KvcalCache(Cache):
    """A transformers cache keeping every layer's K/V with a kvcal method.

    Args:
        config: the model's config (``model.config``); its ``_attn_implementation`` is set to ``"kvcal"``.
        method: ``fp16``, ``kcvt2|3|4``, ``h2o2|3|4``, ``expander2|3|4``, ``hex2|3|4`` or ``h2o-evict``.
        bundle: a kvcal bundle (path or :class:`kvcal.Bundle`) to take the expander mask from.
        mask_cache: a :class:`kvcal.MaskCache` to take masks from (default: a new one, with the bundle attached).
        block, hh_ratio, recent_window, sparsity, mode: the HEX options (:class:`kvcal.HexLayerCache`).
        budget: the fraction of tokens ``h2o-evict`` keeps.
    """

    def __init__(self, config, method: str = "hex4", bundle=None, *, mask_cache=None, block: int = 96,
                 hh_ratio: float = 0.02, recent_window: int = 8, sparsity: float = 1.0 / 32,
                 mode: str = "append", budget: float = 0.5):
        if method.startswith("chess") or method == "hetero":
            raise ValueError(
                f"method '{method}' is not offered as a transformers cache (see kvcal.hf's documentation); "
                f"use one of {', '.join(kvcal.HEX_METHODS)}, h2o-evict"
            )
        if method != "h2o-evict" and method not in kvcal.HEX_METHODS:
            raise ValueError(f"unknown method '{method}': use one of {', '.join(kvcal.HEX_METHODS)}, h2o-evict")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layer_types = getattr(text, "layer_types", None)
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"kvcal.hf supports full-attention layers only; the model has {sorted(set(layer_types))}")
        self.method = method
        self._hex = dict(block=block, hh_ratio=hh_ratio, recent_window=recent_window, sparsity=sparsity, mode=mode)
        self._budget = budget
        self.q_heads = text.num_attention_heads
        if isinstance(bundle, (str, bytes)) or hasattr(bundle, "__fspath__"):
            import os

            bundle = kvcal.Bundle.open(os.fsdecode(bundle))
        self.bundle = bundle
        self.mask_cache = mask_cache
        self.mask = None
        if method != "h2o-evict" and (method.startswith("expander") or method.startswith("hex")):
            if self.mask_cache is None:
                self.mask_cache = kvcal.MaskCache()
                if bundle is not None:
                    self.mask_cache.attach(bundle)
        super().__init__(layers=[KvcalLayer(self, i) for i in range(text.num_hidden_layers)])
        config._attn_implementation = ATTENTION_NAME
        if text is not config:
            text._attn_implementation = ATTENTION_NAME

    def _make_runtime(self, kv_heads: int, head_dim: int):
        if self.method == "h2o-evict":
            return kvcal.H2OEvictCache(kv_heads, self.q_heads, head_dim, self._budget)
        if self.mask_cache is not None and self.mask is None:
            self.mask = self.mask_cache.get(self._hex["block"], head_dim, self._hex["sparsity"])
        return kvcal.HexLayerCache(kv_heads, head_dim, self.method, self.mask, **self._hex)

    def bytes(self) -> int:
        """Bytes the runtime caches store, all layers (the runtime's accounting)."""
        return sum(layer.bytes() for layer in self.layers)

    def fp16_bytes(self) -> int:
        """The same tokens kept in fp16, all layers."""
        return sum(layer.fp16_bytes() for layer in self.layers)
