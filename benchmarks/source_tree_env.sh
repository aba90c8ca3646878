# Sourced by the GPU scripts: the checkout is not pip-installed on the device, so make `orl_jax` and
# `orl_jax_kernels` importable from the source tree. A tree from before session 36 (run_ab.sh's baseline worktrees)
# keeps its kernels in kernels/: a shim folder then gives them their import name.
if [ -d "$PWD/orl_jax_kernels" ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  shim=$(mktemp -d); ln -sfn "$PWD/kernels" "$shim/orl_jax_kernels"
  export PYTHONPATH="$PWD:$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
