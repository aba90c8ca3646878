"""The one place orl_jax sets XLA flags and JAX settings.

Called by the CLI, the recipes and the benchmarks before JAX starts its backends (a library user calls it
themselves, first thing, or sets the same things by hand):

- `--xla_gpu_enable_triton_gemm=false`: XLA's autotuned Triton GEMMs reach ~26% of HBM bandwidth on the small-M
  (batch-1 decoding) GEMMs of a 4B model on an H200; cuBLAS reaches ~57% (../shared/REFERENCE.md: a Qwen3-4B
  block-32 step costs 7.8 ms vs 4.5 ms). Only the GPU backend reads it.
- `--xla_gpu_dot_merger_threshold_mb=0`: XLA otherwise merges GEMMs that share an input into one GEMM over a
  concatenated weight, a copy of the weights in every layer of every forward (~25 us per 26B layer when
  DiffusionGemma's q / k / v were separate: benchmarks/results/2026-11-30_dg_in_place_h200x2.md). Both models now
  store such projections fused (qkv, gate_up), so the flag guards against merges of any other GEMMs sharing an
  input; unmerged, each GEMM reads its weight where it lies.
- a persistent compilation cache, so a second process reuses compiled programs (generate() on a 4B model takes
  minutes to compile cold); GPU / TPU installs only (see configure).

Loop mode: the engine's while_loop has a data-dependent predicate, which XLA copies to the host each iteration
unless WHILE/CONDITIONAL command buffers are on. Those alone made a step slower (REFERENCE.md's plain-XLA probe;
our engine: +0.1-0.3 ms). With the layer scan unrolled inside the command buffer and graphs of any size they pay
off for Qwen3: ENGINE_COMPILER_OPTIONS, per compiled program (jax.jit's compiler_options), not process-wide.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_XLA_FLAGS = ("--xla_gpu_enable_triton_gemm=false", "--xla_gpu_dot_merger_threshold_mb=0")

# generate()'s compiler options for plain Qwen3 / QwenDLM calls on one device (decode/engine.py: not for streaming,
# capture, or calls inside another trace): CUDA graphs (command buffers) that also hold the while loops and
# conditionals, known-trip-count loops (the layer scan) unrolled inside the graph, and graphs of any size. On an H200
# (benchmarks/results/2026-11-30_engine_command_buffers_h200x2.md), Qwen3-4B: the engine loop's overhead ~36 -> 17-20
# us per step, a denoising step -0.06 to -0.14 ms. DiffusionGemma takes them inside DG_COMPILER_OPTIONS below (alone,
# before concurrent branches, its forward was 1 ms slower with them: 19.19 vs 18.16 ms). Not where XLA_FLAGS sets
# --xla_gpu_enable_command_buffer (the user's choice wins). Only GPU backends read them.
ENGINE_COMPILER_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL,DYNAMIC_SLICE_FUSION",
    "xla_gpu_command_buffer_unroll_loops": True,
    "xla_gpu_graph_min_graph_size": 1,
}

# generate()'s compiler options for plain DiffusionGemma calls on one device (same conditions as above; not where
# XLA_FLAGS sets --xla_gpu_command_buffer_scheduling_mode or --xla_gpu_enable_command_buffer). Two parts:
# - XLA's concurrent command buffers, whose kernels run in the order of their data dependencies rather than one after
#   the other (CUDA graph branches), so e.g. the dense MLP's GEMMs may overlap the MoE's routing kernels: on an H200
#   the 26B forward took 17.52 against 17.89 ms, 23.09 against 23.43, and 17.49 against 17.79 / 17.86 in three calls
#   (benchmarks/results/2026-12-01_dg_concurrent_graphs_h200.md);
# - ENGINE_COMPILER_OPTIONS' loops inside the graph, each sliding-layer loop unrolled there (the HLO keeps its while
#   loops, so weights stay in place and compile time does not grow). Host-run loops cost ~10 us per layer at each
#   iteration's start. In one process, 8 forwards in a device loop: 15.29 / 15.31 against 15.47 / 15.50 ms per
#   forward; generate() 0.815 against 0.825 s (benchmarks/results/2026-12-01_dg_graph_loops_h200.md). One forward per
#   call gets slower (16.0-16.2 against 15.65 ms): its one large graph is updated with each call's new buffers on the
#   host, exposed whenever the GPU waits for the call.
# The Qwen3-4B step was unchanged by concurrent branches (3.48-3.53 ms either way), so Qwen3 keeps
# ENGINE_COMPILER_OPTIONS alone.
DG_COMPILER_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT", **ENGINE_COMPILER_OPTIONS}


def configure(compilation_cache_dir: str | os.PathLike | None = "~/.cache/orl_jax/xla",
              xla_flags: tuple[str, ...] = DEFAULT_XLA_FLAGS) -> None:
    """Set orl_jax's XLA flags (unless the user already set the same flag) and the compilation cache.

    The persistent cache is for accelerators only: on the CPU backend a multi-device program (several fake
    devices, collectives inside the layer scan) reloaded from it deadlocked its devices (jax 0.10.2, seen in
    tests/test_recipe.py's resume), and CPU programs compile in seconds anyway."""
    current = os.environ.get("XLA_FLAGS", "")
    have = xla_flags_set()
    add = [f for f in xla_flags if f.split("=")[0] not in have]
    if add:
        os.environ["XLA_FLAGS"] = " ".join([current, *add]).strip()
    import jax

    if compilation_cache_dir is not None and _accelerator_installed():
        path = Path(compilation_cache_dir).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def xla_flags_set() -> set[str]:
    """The names of the flags XLA_FLAGS sets now ("--xla_..."): the user's, which orl_jax's own choices give way to."""
    return {f.split("=")[0] for f in os.environ.get("XLA_FLAGS", "").split()}


def _accelerator_installed() -> bool:
    """A GPU / TPU PJRT plugin is importable and JAX_PLATFORMS does not pin the CPU (checked without starting
    JAX's backends, which jax.distributed.initialize must precede)."""
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms and set(platforms) <= {"cpu"}:
        return False
    return any(importlib.util.find_spec(n) for n in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins",
                                                      "libtpu"))


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, local_device_count: int | None = None) -> None:
    """Join a multi-host (or multi-process) JAX job before any array is created.

    With no arguments jax.distributed.initialize reads the cluster from the environment (SLURM, GKE, ...); on CPU
    (tests, two processes on one machine) the cross-process collectives use gloo. Every process then sees the
    global device list; data pipelines read their share by jax.process_index() (orl_jax.data.pipeline)."""
    import jax

    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    # CPU devices need a collectives backend across processes; GPUs use NCCL whatever this says
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):  # a jax without the option: its CPU default applies
        pass
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)

