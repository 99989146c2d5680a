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
  observed for the heavy hitters. A step of several tokens (chunked scoring,
  assisted decoding) runs them through the runtime one at a time inside each
  layer (append, attend, observe), so it computes exactly what that many
  one-token steps compute, with the model's dense layers batched.
- Prefill once, compress many ways: :func:`prefill` runs a prompt at full
  precision and keeps every layer's keys, values and attention column sums
  (a :class:`Prefix`); :meth:`KvcalCache.load_prefix` fills a cache from it as
  its own prefill would have (the prompt's attention never reads a compressed
  cache), so one prefill serves every method.

What differs from the C++ runtime driven by recorded data: nothing in the
caches; the heavy-hitter scores come from the live model's weights (the
compressed cache's own during decode) rather than from a recording. Not
supported: batches > 1, sliding-window layers, device tensors. The
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
        self._step = None  # float16 (k, v) [kv_heads, n, head_dim] of a decode step until it attends

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
            # Appended token by token in attention(), each right before its own query attends.
            self._step = (_to_half_numpy(key_states), _to_half_numpy(value_states))
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
        k, v = self._step
        self._step = None
        n = k.shape[1]
        q = query[0].detach().float().transpose(0, 1).contiguous().numpy()  # [n, Hq, D]
        out = np.empty(q.shape, np.float32)
        probs = None
        for t in range(n):
            self.runtime.append(k[:, t : t + 1], v[:, t : t + 1])
            probs = self.runtime.attend(q[t], scale=float(scaling), out=out[t], return_probs=True)[1]
            self.runtime.observe(probs)
        out_t = torch.from_numpy(out).to(query.dtype)[None]  # [1, n, Hq, D], as eager attention returns it
        # One token's weights as eager returns them; a multi-token step's rows differ in length.
        weights = torch.from_numpy(probs).to(query.dtype)[None, :, None, :] if n == 1 else None
        return out_t, weights

    def get_mask_sizes(self, query_length: int):
        return self.tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.tokens

    def get_max_length(self) -> int:
        return -1

    def load_prefix(self, keys, values, scores):
        """Fills an empty layer with a prompt prefilled elsewhere (see :meth:`KvcalCache.load_prefix`)."""
        if self.tokens:
            raise RuntimeError(f"kvcal.hf: layer {self.layer_idx} already holds {self.tokens} tokens")
        self.lazy_initialization(keys, values)
        n = keys.shape[-2]
        scores = np.ascontiguousarray(scores, dtype=np.float32)
        if scores.ndim != 2 or scores.shape[1] != n:
            raise ValueError(f"kvcal.hf: layer {self.layer_idx}: scores of shape {scores.shape}, expected [q_heads, {n}]")
        self.runtime.observe(scores)
        self.runtime.append(_to_half_numpy(keys), _to_half_numpy(values))
        self.tokens = n

    def reset(self):
        self.runtime = None
        self.tokens = 0
        self._prompt = None
        self._step = None
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
        method: ``fp16``, ``kcvt2|3|4``, ``h2o2|3|4``, ``expander2|3|4``, ``hex2|3|4`` or ``h2o-evict``; a
            quantizing method may end in ``@int14`` or ``@int8`` (decode with 14- or 8-bit integer dot products,
            e.g. ``hex4@int14``).
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
        if method != "h2o-evict" and not kvcal.is_hex_method(method):
            raise ValueError(f"unknown method '{method}': use one of {', '.join(kvcal.HEX_METHODS)}, h2o-evict "
                             "(any but fp16 and h2o-evict may end in @int14 or @int8)")
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

    def load_prefix(self, prefix: "Prefix") -> "KvcalCache":
        """Fills this (empty) cache with a prompt that :func:`prefill` ran: each layer observes the prompt's
        attention column sums, then takes its keys and values, exactly as the cache's own prefill does. Returns
        self; the next forward continues at position ``prefix.tokens``."""
        if len(prefix.keys) != len(self.layers):
            raise ValueError(f"kvcal.hf: the prefix has {len(prefix.keys)} layers, the cache {len(self.layers)}")
        for layer, k, v, s in zip(self.layers, prefix.keys, prefix.values, prefix.scores):
            layer.load_prefix(k, v, s)
        return self

    def bytes(self) -> int:
        """Bytes the runtime caches store, all layers (the runtime's accounting)."""
        return sum(layer.bytes() for layer in self.layers)

    def fp16_bytes(self) -> int:
        """The same tokens kept in fp16, all layers."""
        return sum(layer.fp16_bytes() for layer in self.layers)


class Prefix:
    """A prompt run once at full precision (:func:`prefill`): per layer its keys and values
    (torch, [1, kv_heads, tokens, head_dim], after RoPE) and its attention column sums per query head
    (float32 NumPy [q_heads, tokens]: the heavy-hitter scores a cache's own prefill observes), plus the
    logits at its last position."""

    def __init__(self, keys, values, scores, last_logits):
        self.keys, self.values, self.scores, self.last_logits = keys, values, scores, last_logits

    @property
    def tokens(self) -> int:
        return int(self.keys[0].shape[-2])

    def dynamic_cache(self, config):
        """A transformers DynamicCache holding the prefix (the uncompressed reference)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=config)
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            cache.update(k.clone(), v.clone(), i)
        return cache


PREFILL_ATTENTION_NAME = "kvcal_prefill"
_prefill_state = threading.local()


def _prefill_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal softmax attention of a whole prompt, ``rows`` queries at a time and each block only over the keys
    it can see (half the work of a full square), in preallocated buffers (long prompts allocate nothing per
    block); adds every query's weights into per-query-head column sums. Numerically the model's eager attention
    up to float rounding order."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise RuntimeError("kvcal.hf.prefill: the prompt must be the first tokens of a batch-1 sequence")
    _, hq, n, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    rows = max(1, min(n, getattr(_prefill_state, "rows", 256)))
    q = query[0].reshape(hkv, g, n, d)
    k, v = key[0], value[0]
    out = torch.empty(1, n, hq, d, dtype=query.dtype)
    scores = torch.zeros(hkv, g, n, dtype=torch.float32)
    buf = torch.empty(hkv * g * rows * n, dtype=query.dtype)
    obuf = torch.empty(hkv * g * rows * d, dtype=query.dtype)
    causal = None
    for s in range(0, n, rows):
        e = min(n, s + rows)
        r = e - s
        qc = (q[:, :, s:e] * scaling).reshape(hkv, g * r, d)
        w = buf[: hkv * g * r * e].view(hkv, g * r, e)
        torch.bmm(qc, k[:, :e].transpose(1, 2), out=w)
        w4 = w.view(hkv, g, r, e)
        if attention_mask is not None:
            w4.add_(attention_mask[0, 0, s:e, :e] if attention_mask.dim() == 4 else attention_mask[s:e, :e])
        else:
            if causal is None or causal.shape[0] != r:
                causal = torch.full((r, r), float("-inf"), dtype=query.dtype).triu_(1)
            w4[..., s:e].add_(causal)
        w.sub_(w.amax(dim=-1, keepdim=True)).exp_()
        w.div_(w.sum(dim=-1, keepdim=True))
        o = obuf[: hkv * g * r * d].view(hkv, g * r, d)
        torch.bmm(w, v[:, :e], out=o)
        out[0, s:e] = o.view(hkv, g, r, d).permute(2, 0, 1, 3).reshape(r, hq, d)
        scores[:, :, :e] += w4.sum(dim=2)
    sink = getattr(_prefill_state, "scores", None)
    if sink is not None:
        sink[module.layer_idx] = scores.reshape(hq, n).numpy()
    return out, None


ALL_ATTENTION_FUNCTIONS.register(PREFILL_ATTENTION_NAME, _prefill_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(PREFILL_ATTENTION_NAME, eager_mask)


def prefill(model, input_ids, *, rows: int = 256) -> Prefix:
    """Runs the prompt ``input_ids`` ([1, n] or [n]) through ``model`` once, at full precision with the model's
    softmax attention (``rows`` queries at a time), and returns its :class:`Prefix`. Give the prefix to
    :meth:`KvcalCache.load_prefix` (any number of caches, any methods) or :meth:`Prefix.dynamic_cache`."""
    from transformers import DynamicCache

    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    if ids.shape[0] != 1:
        raise ValueError(f"kvcal.hf.prefill: batch size 1, got {ids.shape[0]}")
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    cache = DynamicCache(config=config)
    saved = config._attn_implementation
    _prefill_state.scores, _prefill_state.rows = {}, int(rows)
    try:
        config._attn_implementation = PREFILL_ATTENTION_NAME
        if text is not config:
            text._attn_implementation = PREFILL_ATTENTION_NAME
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        scores = _prefill_state.scores
    finally:
        _prefill_state.scores = None
        config._attn_implementation = saved
        if text is not config:
            text._attn_implementation = saved
    layers = cache.layers
    if len(scores) != len(layers):
        raise RuntimeError(f"kvcal.hf.prefill: {len(scores)} of {len(layers)} layers ran the recording attention")
    return Prefix([layer.keys for layer in layers], [layer.values for layer in layers],
                  [scores[i] for i in range(len(layers))], out.logits[0, -1].detach())
