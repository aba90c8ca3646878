# Sourced by the GPU scripts: the checkout is not pip-installed on the device, so make `orl_jax` and
# `orl_jax_kernels` (the kernels/ folder under its installed name) importable from the source tree.
shim=$(mktemp -d); ln -sfn "$PWD/kernels" "$shim/orl_jax_kernels"
export PYTHONPATH="$PWD:$shim${PYTHONPATH:+:$PYTHONPATH}"
