#!/usr/bin/env bash
# Issue #4's record: DiffusionGemma 26B-A4B on one GPU beside transformers' own generate() in the same call.
# First transformers eager (random bf16 weights, prompt 512, 256 new tokens, 48 denoising forwards; its second rep
# is the number to compare), then orl_jax at its defaults: the decoder forward 48 per device loop, generate() (one
# untimed call + median of 3, then the steady state), other keys, and generate()'s parts. Extra arguments go to
# benchmarks/diffusion_gemma_generate.py (e.g. --ab-workspace, --generate-ab 'MODULE.NAME=JSON', --set ...).
# PEER=0 runs ours alone; PARTS=0 leaves out --parts (~80 s on the device). XLA_LOG=1 also logs XLA's command
# buffers and each generate() call's start, and summarizes them (benchmarks/command_buffer_log.py).
# Usage: bash benchmarks/run_dg_bench.sh OUTDIR [diffusion_gemma_generate.py args]   (peers copied to .carry/peers;
#   as a device job: bash benchmarks/run_gpu_jobs.sh $OUT 570 '0|bash benchmarks/run_dg_bench.sh $BENCH')
# 2026-11-29's record ran an earlier version of this script (transformers compiled too, a kernel profile).
set -uo pipefail
out=$1; shift; mkdir -p "$out"; export PYTHONUNBUFFERED=1
peers=${PEERS:-.carry/peers}
here=$(dirname "$0")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
if [ "${PEER:-1}" = 1 ]; then  # PEER=0: ours alone (an H100: the peer's eager run does not fit one)
  NEW=256 timeout 110 python3 "$peers/hf_diffusion_gemma_generate.py" eager > "$out/peer_dg.txt" 2>&1
fi
parts=--parts; [ "${PARTS:-1}" = 0 ] && parts=
dg=(python3 "$here/diffusion_gemma_generate.py" --moe-impl pallas --fused-experts --looped 48 $parts --key-spread 4
    "$@" --out "$out/dg.jsonl")
if [ "${XLA_LOG:-0}" = 1 ]; then
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 "${dg[@]}" --mark-calls > "$out/dg.log" 2> "$out/xla_log.txt"
  echo "== dg exit $?" >> "$out/dg.log"
  # the summary, then the log's last 40 other lines (the errors, if any)
  python3 "$here/command_buffer_log.py" "$out/xla_log.txt" --out "$out/command_buffers.jsonl" --others 40 >> "$out/dg.log"
  gzip -f "$out/xla_log.txt"  # comes back for a closer look (session 58's summary missed lines it did not parse)
else
  "${dg[@]}" > "$out/dg.log" 2>&1
  echo "== dg exit $?" >> "$out/dg.log"
fi
for f in "$out/peer_dg.txt" "$out/dg.log"; do [ -e "$f" ] && tail -n 8 "$f"; done
grep -q "^== dg exit 0" "$out/dg.log"  # the job's status: ours ran through
