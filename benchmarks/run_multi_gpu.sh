#!/usr/bin/env bash
# Several GPUs of one host, each measurement side by side with one GPU in the same call (never concurrently):
#   1. data-parallel (FSDP) training, stage-0 step of the h200 recipe: 1 GPU vs N GPUs (loss curves + tokens/s),
#      and the same step in float32 on 1 GPU (what mixed precision buys);
#   2. Qwen3-4B-shape denoising step: tensor=1 vs tensor=N;
#   3. DiffusionGemma 26B-A4B generate(): one GPU vs expert-parallel over N.
# Usage: bash benchmarks/run_multi_gpu.sh OUTDIR [N]   (grain from carried wheels: ../shared/tools/gpu_wheels.sh)
set -uo pipefail
out=$1; n=${2:-2}; mkdir -p "$out"; export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$out/gpu.txt" 2>&1
t=$out/train_scaling.jsonl
timeout 150 python3 benchmarks/train_scaling.py --devices 1 --steps 150 --out "$t" > "$out/train_1.log" 2>&1
timeout 150 python3 benchmarks/train_scaling.py --devices "$n" --steps 150 --out "$t" > "$out/train_$n.log" 2>&1
timeout 120 python3 benchmarks/train_scaling.py --devices 1 --steps 60 --compute-dtype float32 --out "$t" \
  > "$out/train_1_fp32.log" 2>&1
e=$out/engine_tp.jsonl
for tp in 1 "$n"; do
  timeout 120 python3 benchmarks/engine_step.py --phase step --tensor "$tp" --out "$e" > "$out/engine_tp$tp.log" 2>&1
done
d=$out/dg_ep.jsonl
for ep in 1 "$n"; do
  timeout 150 python3 benchmarks/diffusion_gemma_generate.py --expert "$ep" --out "$d" > "$out/dg_ep$ep.log" 2>&1
done
grep -h summary "$t"; grep -h denoise_step "$e"; grep -h generate "$d"
tail -n 3 "$out"/*.log
