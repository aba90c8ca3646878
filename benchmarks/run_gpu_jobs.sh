#!/usr/bin/env bash
# Several jobs side by side on the GPUs of one host, each on its own GPUs (CUDA_VISIBLE_DEVICES), each stopped
# with SIGTERM after SECONDS (a recipe stage then saves its checkpoint and exits 75, which the log shows;
# `--resume` continues it in a later call while the machine stays warm: runs live in the ignored outputs/ folder
# of the checkout).
# Everything that comes back is packed into OUTDIR/results.tgz (the device returns at most 8 files): the job
# logs, gpu.txt, every outputs/*/{report.md,results.jsonl,accuracy_vs_tpf.png,recipe.json,stage*/logs/*.jsonl} and
# any *.jsonl a job writes under OUTDIR/bench/.
# Usage: bash benchmarks/run_gpu_jobs.sh OUTDIR SECONDS 'GPUS|command' ['GPUS|command' ...]
#   e.g. ... $OUT 540 '0,1|python3 recipes/train_qwendlm.py --preset h200 --out outputs/h200 --skip-stage2' \
#                     '2|python3 benchmarks/attention_probe.py --out $BENCH/attention_probe.jsonl'
# A job's command runs under bash -c with BENCH=OUTDIR/bench; chain steps with && so a stopped step ends the job.
set -uo pipefail
out=$1; secs=$2; shift 2
mkdir -p "$out/logs" "$out/bench"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30 BENCH=$out/bench
source "$(dirname "$0")/source_tree_env.sh"
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; } > "$out/logs/gpu.txt" 2>&1
i=0
for job in "$@"; do
  gpus=${job%%|*}; cmd=${job#*|}
  ( echo "== GPUs $gpus: $cmd"; start=$(date +%s)
    CUDA_VISIBLE_DEVICES=$gpus timeout --preserve-status -s TERM -k 60 "$secs" bash -c "$cmd"
    echo "== exit $? after $(( $(date +%s) - start )) s" ) > "$out/logs/job$i.log" 2>&1 &
  i=$((i + 1))
done
wait
runs=()
for f in outputs/*/{report.md,results.jsonl,accuracy_vs_tpf.png,recipe.json} outputs/*/stage*/logs/metrics.jsonl; do
  [ -e "$f" ] && runs+=("$f")
done
pack=(-C "$out" logs bench)
[ ${#runs[@]} -gt 0 ] && pack+=(-C "$PWD" "${runs[@]}")
tar czf "$out/results.tgz" "${pack[@]}"
rm -rf "$out/logs" "$out/bench"
tar xzf "$out/results.tgz" -O --wildcards 'logs/job*.log' | grep "^==\|^\[\|Error" | cut -c1-260
tar xzf "$out/results.tgz" -O --wildcards 'bench/*.jsonl' 2>/dev/null |
  grep -h '"summary"\|denoise_step\|"generate"\|decode_forward\|ms_fwd_bwd\|ms_per_layer\|error' | cut -c1-300
