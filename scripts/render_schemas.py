#!/usr/bin/env python3
"""Renders schemas/*.json into docs/schemas.md (one table per group).

Usage: scripts/render_schemas.py [--check]   (--check: exit 1 if docs/schemas.md is stale)
"""
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fmt_spec(spec):
    if "ref" in spec:
        return f"see `{spec['ref']}`", ""
    parts = []
    for key in ("type", "dtype"):
        if key in spec:
            v = spec[key]
            parts.append(" or ".join(v) if isinstance(v, list) else str(v))
    if "rank" in spec:
        parts.append(f"rank {spec['rank']}")
    if "shape" in spec:
        parts.append("[" + ", ".join(spec["shape"]) + "]")
    rules = []
    for key in ("const", "enum", "min", "max"):
        if key in spec:
            rules.append(f"{key} {json.dumps(spec[key])}")
    if spec.get("optional"):
        rules.append("optional")
    if "required_if" in spec:
        rules.append(f"required if {spec['required_if']}")
    for inv in spec.get("invariants", []):
        rules.append(inv)
    return " ".join(parts), "; ".join(rules + ([spec["doc"]] if "doc" in spec else []))


def render_node(node, where, out):
    if "ref" in node:
        out.append(f"`{where}`: the layout of `{node['ref']}`.\n")
        return
    rows = []
    for kind in ("attributes", "datasets"):
        block = node.get(kind, {})
        if "ref" in block:
            rows.append(f"| ({kind}) | see `{block['ref']}` | |")
            continue
        for name, spec in block.items():
            t, r = fmt_spec(spec)
            rows.append(f"| {'@' if kind == 'attributes' else ''}{name} | {t} | {r} |")
    if rows:
        out.append(f"`{where}`" + (f" — {node['doc']}" if "doc" in node else "") + "\n")
        out.append("| name (@: attribute) | type | rules |\n| --- | --- | --- |")
        out.extend(rows)
        out.append("")
    for name, sub in node.get("groups", {}).items():
        render_node(sub, f"{where.rstrip('/')}/{name}", out)
    for name, sub in node.get("children", {}).items():
        render_node(sub, f"{where.rstrip('/')}/<{'id' if name == '*' else name}>", out)


def render():
    out = ["# kvcal artifact schemas", "",
           "Generated from `schemas/*.json` by `scripts/render_schemas.py`; `kvcal validate` checks files against "
           "the same schemas (compiled into kvcal).", ""]
    for path in sorted(glob.glob(os.path.join(ROOT, "schemas", "*.json"))):
        with open(path) as f:
            s = json.load(f)
        out.append(f"## `{s['format']}` v{s['format_version']} ({os.path.basename(path)})\n")
        if "$comment" in s:
            out.append(s["$comment"] + "\n")
        if "user_block" in s:
            out.append(f"HDF5 user block ({s['user_block']['size']} bytes): {s['user_block']['doc']}\n")
        render_node(s["root"], "/", out)
    return "\n".join(out) + "\n"


def main():
    text = render()
    target = os.path.join(ROOT, "docs", "schemas.md")
    if "--check" in sys.argv:
        with open(target) as f:
            if f.read() != text:
                sys.exit("docs/schemas.md is stale: run scripts/render_schemas.py")
        return
    with open(target, "w") as f:
        f.write(text)
    print(target)


if __name__ == "__main__":
    main()
