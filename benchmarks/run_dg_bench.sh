#!/usr/bin/env bash
# DiffusionGemma 26B-A4B side by side on one GPU: transformers' generate() (eager, then torch.compile: ~3 min to
# compile), then orl_jax's with a kernel profile and the compiled decoder's HLO.
# Usage: bash benchmarks/run_dg_bench.sh OUTDIR   (peers copied to .carry/peers)
set -uo pipefail
out=$1; mkdir -p "$out"; export PYTHONUNBUFFERED=1
peers=${PEERS:-.carry/peers}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
NEW=256 timeout 380 python3 $peers/hf_diffusion_gemma_generate.py eager compile > "$out/peer_dg.txt" 2>&1
timeout 200 python3 benchmarks/diffusion_gemma_generate.py --moe-impl pallas --profile --out "$out/dg.jsonl" \
  > "$out/dg.log" 2>&1
tail -n 8 "$out/peer_dg.txt" "$out/dg.log"
