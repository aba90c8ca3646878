#!/usr/bin/env bash
# One device call of `recipes/train_qwendlm.py --preset h200`, resumable across calls while the machine stays
# warm (the run lives in the ignored outputs/ folder of the checkout, which a warm machine keeps between calls).
# Stops itself with SIGTERM (orl_jax saves a checkpoint and exits cleanly) before the call's 10-minute limit, and
# brings back at most 8 files: log, report, results, plot, recipe.json and the stage-0/1 metric logs.
# Usage: bash benchmarks/run_h200_recipe.sh OUTDIR SECONDS [recipe args...]   e.g. ... $OUT 540 --skip-stage2
set -uo pipefail
out=$1; secs=$2; shift 2; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
run=outputs/h200
resume=(); [ -e "$run/recipe.json" ] && resume=(--resume)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/recipe.log" 2>&1
timeout -s TERM "$secs" python3 recipes/train_qwendlm.py --preset h200 --out "$run" "${resume[@]}" "$@" \
  >> "$out/recipe.log" 2>&1
echo "exit status $?" >> "$out/recipe.log"
for f in report.md results.jsonl accuracy_vs_tpf.png recipe.json; do [ -e "$run/$f" ] && cp "$run/$f" "$out/"; done
for s in stage0 stage1; do [ -e "$run/$s/logs/metrics.jsonl" ] && cp "$run/$s/logs/metrics.jsonl" "$out/${s}_metrics.jsonl"; done
grep "^\[\|exit status" "$out/recipe.log" | cut -c1-300
