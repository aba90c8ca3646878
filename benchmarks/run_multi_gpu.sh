#!/usr/bin/env bash
# Several GPUs of one host, each measurement side by side with one GPU in the same call (never concurrently):
#   train  data-parallel (FSDP) training, stage-0 step of the h200 recipe: 1 GPU vs N GPUs (loss curves + tokens/s)
#   tp     Qwen3-4B-shape denoising step: tensor=1 vs tensor=N
#   dg     DiffusionGemma 26B-A4B generate(): dense vs bucketed experts on one GPU, expert-parallel over N
#   probe  training attention: orl_jax vs jax.nn.dot_product_attention (xla, cudnn), one GPU
#   layers where a Qwen3-4B layer's denoising time goes (benchmarks/layer_breakdown.py), one GPU
# Usage: bash benchmarks/run_multi_gpu.sh OUTDIR [N] [PARTS]   (default PARTS "train tp dg"; grain from carried
# wheels: ../shared/tools/gpu_wheels.sh). At most 7 files come back: gpu.txt, runs.log and one .jsonl per part.
set -uo pipefail
out=$1; n=${2:-2}; parts=${3:-"train tp dg"}; mkdir -p "$out"; export PYTHONUNBUFFERED=1
log=$out/runs.log
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } > "$out/gpu.txt" 2>&1
run() { echo "== $*" >> "$log"; "$@" >> "$log" 2>&1; echo "== exit $?" >> "$log"; }
for part in $parts; do
  case $part in
    train) for d in 1 "$n"; do
             run timeout 150 python3 benchmarks/train_scaling.py --devices "$d" --steps 150 --out "$out/train_scaling.jsonl"
           done ;;
    tp)    for tp in 1 "$n"; do
             run timeout 120 python3 benchmarks/engine_step.py --phase step --tensor "$tp" --out "$out/engine_tp.jsonl"
           done ;;
    dg)    run timeout 150 python3 benchmarks/diffusion_gemma_generate.py --moe-impl dense --out "$out/dg_ep.jsonl"
           for ep in 1 "$n"; do
             run timeout 150 python3 benchmarks/diffusion_gemma_generate.py --expert "$ep" --out "$out/dg_ep.jsonl"
           done ;;
    probe) run timeout 150 python3 benchmarks/attention_probe.py --out "$out/attention_probe.jsonl" ;;
    layers) run timeout 150 python3 benchmarks/layer_breakdown.py --out "$out/layer_breakdown.jsonl" ;;
    *)     echo "unknown part $part" >> "$log" ;;
  esac
done
grep -h '"summary"\|denoise_step\|"generate"\|ms_fwd_bwd\|ms_per_layer\|error' "$out"/*.jsonl | cut -c1-400
grep "^== exit [^0]" "$log"
