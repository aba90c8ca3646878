# Sourced by the GPU scripts: the checkout is not pip-installed on the device, so make `orl_jax` and
# `orl_jax_kernels` importable from the source tree. The kernels live in kernels/ (installed under the name
# orl_jax_kernels by pyproject's package-dir): a shim folder, first on the path, gives them that name. A tree of
# session 36 (run_ab.sh's baseline worktrees) had them in orl_jax_kernels/ itself; a checkout that moved on from
# one may keep an orl_jax_kernels/ of __pycache__ folders only (git leaves untracked files), which the shim outranks.
if [ -f "$PWD/orl_jax_kernels/__init__.py" ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  shim=$(mktemp -d); ln -sfn "$PWD/kernels" "$shim/orl_jax_kernels"
  export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
