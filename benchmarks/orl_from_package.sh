#!/usr/bin/env bash
# One stage-2 run of issue #6's records from the fixed base package (its README:
# benchmarks/results/2026-12-02_base_package_h200/): NAME LR2 ROUNDS [more recipe flags].
# Three of these share one H200 under benchmarks/run_gpu_jobs.sh, hence the memory fraction.
set -euo pipefail
name=$1 lr2=$2 rounds=$3
shift 3
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.3}
exec python3 recipes/train_qwendlm.py --preset h200 --noise mask --base-package "${BASE_PACKAGE:-.carry/pkg_h200_mask}" \
  --out "outputs/$name" --stage2-methods orl --lr2 "$lr2" --orl-rounds "$rounds" "$@"
