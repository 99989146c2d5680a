#!/usr/bin/env python3
"""fp16 decode attention with torch's scaled_dot_product_attention on a GPU:
the baseline of bench_hex_cuda (same shapes: head_dim 128, 8 KV heads, 32
query heads, contexts 32K and 128K, batch 1 and 16, one query token).

Reports per shape the median time of a step (CUDA events, 50 runs after 5
warm-ups) and the bytes it must read (K and V in fp16, the queries) per
second, as JSON lines and a table. GQA through enable_gqa (torch >= 2.5);
older torch expands the KV heads (a copy: the timing then includes it and
says so).

Usage: scripts/bench_sdpa.py [--out FILE]
"""
import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON to this file")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"skipped: torch is not installed ({e})", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("skipped: no CUDA device visible to torch", file=sys.stderr)
        return 77
    dev = torch.device("cuda")
    rows = []
    gqa = "enable_gqa" in F.scaled_dot_product_attention.__doc__
    for ctx in (32 * 1024, 128 * 1024):
        for batch in (1, 16):
            q = torch.randn(batch, 32, 1, 128, device=dev, dtype=torch.float16)
            k = torch.randn(batch, 8, ctx, 128, device=dev, dtype=torch.float16)
            v = torch.randn_like(k)

            def step():
                if gqa:
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                return F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))

            for _ in range(5):
                step()
            times = []
            for _ in range(50):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                step()
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
            times.sort()
            ms = times[len(times) // 2]
            nbytes = 2 * k.numel() * 2 + q.numel() * 2 * 2
            rows.append({"ctx": ctx, "batch": batch, "ms": ms, "bytes": nbytes,
                         "GBps": nbytes / (ms * 1e-3) / 1e9, "enable_gqa": gqa,
                         "device": torch.cuda.get_device_name()})
            del q, k, v
            torch.cuda.empty_cache()
    print(f"{'ctx':>7} {'batch':>5} {'ms':>9} {'GB/s':>8}")
    for r in rows:
        print(f"{r['ctx']:>7} {r['batch']:>5} {r['ms']:>9.3f} {r['GBps']:>8.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
