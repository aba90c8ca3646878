# Sourced by the GPU scripts: the checkout is not pip-installed on the device, so make `orl_jax` and
# `orl_jax_kernels` importable from the source tree. The kernels live in kernels/ (installed under the name
# orl_jax_kernels by pyproject's package-dir): a shim folder gives them that name. A tree of session 36 (run_ab.sh's
# baseline worktrees) had them in orl_jax_kernels/ itself.
if [ -d "$PWD/orl_jax_kernels" ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  shim=$(mktemp -d); ln -sfn "$PWD/kernels" "$shim/orl_jax_kernels"
  export PYTHONPATH="$PWD:$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
