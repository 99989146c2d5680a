#!/usr/bin/env bash
# The main job on defaults: installs what is missing, builds Release, generates
# certified expander masks (the HEX block of 96 tokens x 128 channels at
# rho = 1/32, a long-context lift, and a deterministic LPS mask next to a
# random one), profiles the real SmolLM2 attention dump in data/ into head
# roles and budgets, calibrates the entropy thresholds on it, re-certifies the
# masks, writes the plots, and prints where the results are.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh release
kvcal=build/release/bin/kvcal
out=out/demo
mkdir -p "$out"

echo "== kvcal mask-gen: four distinct 96x128 masks, rho = 1/32 (d1 = 4, d2 = 3), exact certificates"
$kvcal mask-gen --rows 96 --cols 128 --sparsity 0.03125 --count 4 --seed 1 --out "$out/block_96x128.h5"
echo
echo "== kvcal mask-gen: one 8192x128 block-structured lift, rho = 1/32"
$kvcal mask-gen --rows 8192 --cols 128 --sparsity 0.03125 --method lift --out "$out/long_8192x128.h5"
echo
echo "== deterministic next to random: the LPS graph X^{5,13} (1092x1092, degree 6) and a random mask of that shape"
timed() { local t0 t1; t0=$(date +%s.%N); "$@"; t1=$(date +%s.%N); printf '   (%.2f s)\n' "$(echo "$t1 - $t0" | bc -l)"; }
timed $kvcal mask-gen --method lps --lps-p 5 --lps-q 13 --out "$out/lps_1092x1092.h5"
timed $kvcal mask-gen --rows 1092 --cols 1092 --row-degree 6 --seed 1 --out "$out/random_1092x1092.h5"
echo
echo "== kvcal profile-heads: HeteroCache roles and budgets from real SmolLM2-135M attention (data/)"
$kvcal profile-heads data/smollm2_attention.h5 --topk-frac 0.1 --budget 0.5 --out "$out/heads.h5"
${PYTHON:-python3} scripts/plot_heads.py "$out/heads.h5" --out-dir "$out/heads_plots"
echo
echo "== kvcal calibrate-entropy: CHESS re-selection thresholds from the same dump (pages of 16 tokens)"
$kvcal calibrate-entropy data/smollm2_attention.h5 --page-size 16 --percentile 90 --out "$out/entropy.h5"
${PYTHON:-python3} scripts/plot_entropy.py "$out/entropy.h5" --out "$out/entropy.png"
echo
echo "== kvcal mask-gen: a 96x64 mask for SmolLM2's 64-channel heads, rho = 1/16"
$kvcal mask-gen --rows 96 --cols 64 --sparsity 0.0625 --count 2 --out "$out/smollm2_masks.h5"
echo
echo "== kvcal bundle -> validate -> inspect: one checked file for the model"
$kvcal -q bundle --model SmolLM2-135M-Instruct --masks "$out/smollm2_masks.h5" --heads "$out/heads.h5" \
  --entropy "$out/entropy.h5" --model-config data/smollm2_config.json --out "$out/smollm2.kvcal.h5" >/dev/null
$kvcal validate "$out/smollm2.kvcal.h5"
$kvcal inspect "$out/smollm2.kvcal.h5" | head -12
echo "   ... (kvcal inspect --json for machines; scripts/kvcal_artifacts.py reads it with h5py alone)"
echo
echo "== kvcal eval-fidelity: attention error vs KV size, replaying a real 383-token SmolLM2 sample"
echo "   (data/smollm2_long.h5) through every method; the bundle provides the mask, head roles and thresholds"
$kvcal eval-fidelity --dump data/smollm2_long.h5 --bundle "$out/smollm2.kvcal.h5" --sparsity 0.0625 \
  --methods fp16,kcvt3,kcvt4,h2o4,expander4,hex3,hex4,h2o-evict,chess-conservative,chess-moderate,chess-aggressive,hetero \
  --out "$out/fidelity.csv"
${PYTHON:-python3} scripts/plot_fidelity.py "$out/fidelity.csv" --out "$out/fidelity.png"
echo
echo "== kvcal mask-certify: every stored claim re-derived from the CSR"
$kvcal mask-certify "$out/block_96x128.h5" "$out/long_8192x128.h5" "$out/lps_1092x1092.h5" "$out/random_1092x1092.h5"
echo
echo "Results in $out/: block_96x128.h5, long_8192x128.h5, lps_1092x1092.h5, random_1092x1092.h5 (masks),"
echo "  heads.h5 + heads_plots/*.png (head profile), entropy.h5 + entropy.png (re-selection thresholds),"
echo "  smollm2.kvcal.h5 (the bundle for the model), fidelity.csv + fidelity.png (eval-fidelity)"
echo "(layout: schemas/masks.v1.json; list deterministic shapes with: $kvcal mask-gen --list-lps --max-rows 20000)"
