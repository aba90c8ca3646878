#!/usr/bin/env bash
# A/B two versions of the code in one device call, on the same GPU: COMMAND runs in a baseline tree and in this
# one, alternately (base, new, base, new), so drift between calls cannot pass for a speed-up.
# The baseline tree is a `git worktree` of an earlier commit, made here before the call and carried:
#   git worktree add .carry/base 85e92e6          (.carry is ignored; name it in the device call's carry)
# Usage: bash benchmarks/run_ab.sh BASE_TREE OUTDIR 'COMMAND'   (COMMAND writes its results under $AB_OUT)
#   e.g. bash benchmarks/run_ab.sh .carry/base $BENCH/ab \
#          'python3 benchmarks/diffusion_gemma_generate.py --moe-impl pallas --out $AB_OUT/dg.jsonl'
# Results: OUTDIR/{base,new}{1,2}/ with COMMAND's files and its log.txt. ROUNDS=1 runs base, new once each (a
# short device budget); the default is 2.
set -uo pipefail
base=$(realpath "$1"); out=$(realpath -m "$2"); cmd=$3; here=$PWD
env=$(realpath "$(dirname "$0")/source_tree_env.sh")
[ -d "$base" ] || { echo "run_ab.sh: no baseline tree at $1" >&2; exit 2; }
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in base new; do
    dir=$here; [ "$side" = base ] && dir=$base
    mkdir -p "$out/$side$round"
    # each side imports its own tree first: orl_jax and orl_jax_kernels (the shim) ahead of anything inherited
    (cd "$dir" && source "$env" && AB_OUT="$out/$side$round" bash -c "$cmd") > "$out/$side$round/log.txt" 2>&1
    echo "== $side$round: exit $? ($(cd "$dir" && git rev-parse --short HEAD 2>/dev/null || echo "$dir"))"
  done
done
