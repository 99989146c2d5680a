#!/usr/bin/env python3
"""Cut long prompts from texts that ship with the system, one prompt per line (the format of
scripts/record_attention.py --prompts).

Each SOURCE gives one prompt of --tokens tokens (the model's tokenizer), whitespace runs folded to
one space so that the prompt fits on one line:

  PATH[@OFFSET]            a UTF-8 text file, from token OFFSET (default 0)
  topics[@OFFSET]          Python's pydoc topics (pydoc_data.topics, sorted by name, joined)
  modules=A+B+...[@OFFSET] the docstrings of the named standard-library modules, joined

The sources and their SHA-256 are printed on stderr (and kept in data/README.md for the committed
prompt files). Example (the calibration prompts of scripts/calibrate_smollm2.sh):

  python3 scripts/long_prompts.py --gguf /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf --tokens 1280 \\
      --out data/calibration_prompts.txt /usr/share/common-licenses/GPL-1 /usr/share/common-licenses/LGPL-3 \\
      /usr/share/common-licenses/CC0-1.0 modules=subprocess+argparse+json+csv+logging
"""

import argparse
import hashlib
import importlib
import os
import re
import sys


def source_text(spec: str) -> tuple[str, int, str]:
    """(text, token offset, description with checksum)"""
    offset = 0
    if "@" in spec:
        spec, off = spec.rsplit("@", 1)
        try:
            offset = int(off)
        except ValueError:
            sys.exit(f"long_prompts: error: bad offset '{off}' in '{spec}@{off}' (an integer token offset)")
    if spec == "topics":
        from pydoc_data import topics

        text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
        what = f"pydoc topics of Python {sys.version.split()[0]}"
    elif spec.startswith("modules="):
        docs = []
        for name in spec[len("modules="):].split("+"):
            try:
                mod = importlib.import_module(name)
            except ImportError as e:
                sys.exit(f"long_prompts: error: module '{name}': {e}")
            docs.append(mod.__doc__ or "")
        text = "\n\n".join(docs)
        what = f"docstrings of {spec[len('modules='):]} (Python {sys.version.split()[0]})"
    else:
        try:
            text = open(spec, "rb").read().decode("utf-8", errors="replace")
        except OSError as e:
            sys.exit(f"long_prompts: error: {spec}: {e.strerror}")
        what = spec
    return text, offset, f"{what}, sha256 {hashlib.sha256(text.encode()).hexdigest()}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=os.environ.get("KVCAL_SMOLLM2_GGUF",
                                                    "/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf"),
                   help="the model's GGUF file (its tokenizer counts the tokens)")
    p.add_argument("--tokens", type=int, default=1536, help="tokens per prompt (default %(default)s)")
    p.add_argument("--out", required=True, help="prompt file to write (atomically)")
    p.add_argument("sources", nargs="+", metavar="SOURCE")
    args = p.parse_args()
    if args.tokens < 16:
        sys.exit(f"long_prompts: error: --tokens must be at least 16, got {args.tokens}")
    if not os.path.isfile(args.gguf):
        sys.exit(f"long_prompts: error: {args.gguf} does not exist (give --gguf or set KVCAL_SMOLLM2_GGUF)")
    from transformers import AutoTokenizer

    d, name = os.path.split(os.path.abspath(args.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    lines = []
    for spec in args.sources:
        text, offset, what = source_text(spec)
        ids = tok(re.sub(r"\s+", " ", text).strip(), add_special_tokens=False)["input_ids"]
        if len(ids) < offset + args.tokens:
            sys.exit(f"long_prompts: error: {spec}: {len(ids)} tokens, fewer than offset {offset} + {args.tokens}")
        prompt = tok.decode(ids[offset : offset + args.tokens]).replace("\n", " ").strip()
        lines.append(prompt)
        print(f"{spec}: tokens {offset}..{offset + args.tokens} of {len(ids)}; {what}", file=sys.stderr)
    tmp = f"{args.out}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
