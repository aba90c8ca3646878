#!/usr/bin/env bash
# Side-by-side engine benchmark on the GPU machine: PyTorch peers, then orl_jax, one after the other (never
# concurrently). Usage: bash benchmarks/run_engine_bench.sh PART OUTDIR
#   (PART: peers-step | generate | attention | ab | variants)
# attention: sweep the attention kernel's blocks (kernels/decode_attention/bench.py -> attn_tuned.json), then the
# step and its profile with that table.
# ab: the CUDA-graph peer, then the step with the library's attention blocks and with the Blocks() defaults, then
# the profile (kernels named from the compiled module).
# variants: the CUDA-graph peer, then the step once per entry of VARIANTS ('|'-separated engine_step.py flags; an
# empty entry is the defaults), in order, then the peer again: e.g.
#   VARIANTS='|--cached-attention cudnn|--layer-unroll 36' bash benchmarks/run_engine_bench.sh ...
set -uo pipefail
part=$1; out=$2; mkdir -p "$out"
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/source_tree_env.sh"
peers=${PEERS:-.carry/peers}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__)" >> "$out/gpu.txt" 2>&1
if [ "$part" = peers-step ]; then
  { for b in 32 256; do echo "== torch_graph_step BLOCK=$b"; BLOCK=$b timeout 150 python3 $peers/torch_graph_step.py; done
    echo "== hf_qwen3_eager_step BLOCK=32"; BLOCK=32 timeout 150 python3 $peers/hf_qwen3_eager_step.py; } > "$out/peers.txt" 2>&1
  timeout 420 python3 benchmarks/engine_step.py --phase step --out "$out/engine.jsonl" > "$out/step.log" 2>&1
elif [ "$part" = attention ]; then
  timeout 400 python3 kernels/decode_attention/bench.py --out "$out/attn.jsonl" --table "$out/attn_tuned.json" \
    > "$out/attn.log" 2>&1
  for phase in step profile; do
    timeout 200 python3 benchmarks/engine_step.py --phase $phase --attention-table "$out/attn_tuned.json" \
      --out "$out/engine.jsonl" > "$out/${phase}_tuned.log" 2>&1
  done
elif [ "$part" = ab ]; then
  { for b in 32 256; do echo "== torch_graph_step BLOCK=$b"; BLOCK=$b timeout 150 python3 $peers/torch_graph_step.py; done
  } > "$out/peers.txt" 2>&1
  for blocks in library dataclass; do
    timeout 240 python3 benchmarks/engine_step.py --phase step --attention-blocks $blocks --out "$out/engine.jsonl" \
      > "$out/step_$blocks.log" 2>&1
  done
  timeout 200 python3 benchmarks/engine_step.py --phase profile --out "$out/engine.jsonl" > "$out/profile.log" 2>&1
elif [ "$part" = variants ]; then
  graph_peer() { for b in 32 256; do echo "== torch_graph_step BLOCK=$b"; BLOCK=$b timeout 150 python3 $peers/torch_graph_step.py; done; }
  graph_peer > "$out/peers.txt" 2>&1
  IFS='|' read -ra variants <<< "${VARIANTS:-}"
  for i in "${!variants[@]}"; do
    echo "== variant $i: ${variants[$i]:-defaults}" > "$out/step_$i.log"
    # shellcheck disable=SC2086  # the flags split on purpose
    timeout 240 python3 benchmarks/engine_step.py --phase step ${variants[$i]} --out "$out/engine.jsonl" \
      >> "$out/step_$i.log" 2>&1
  done
  graph_peer >> "$out/peers.txt" 2>&1
else
  timeout 300 python3 benchmarks/engine_step.py --phase generate --out "$out/engine.jsonl" > "$out/gen_cold.log" 2>&1
  timeout 200 python3 benchmarks/engine_step.py --phase generate --out "$out/engine.jsonl" > "$out/gen_warm.log" 2>&1
fi
tail -n 30 "$out"/*.txt "$out"/*.log; cat "$out/engine.jsonl"
