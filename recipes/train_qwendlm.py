"""The main job: AR model -> QwenDLM, evaluated on held-out verifiable tasks.

  python recipes/train_qwendlm.py                      # embedded default, CPU, no downloads (`make demo`)
  python recipes/train_qwendlm.py --preset h200 --time-limit 9   # one H200; a stage still running at 9 minutes
                                                       # checkpoints and exits 75: rerun with --resume (stages 0+1
                                                       # take ~10 minutes, ORL ~8, each evaluation ~1.5)
  python recipes/train_qwendlm.py --hf-model DIR       # start from a real Qwen3 checkpoint (skips stage 0)
  ... --resume                                         # continue a killed run from its checkpoints
  ... --resume --stage2-methods orl --no-eval          # one stage-2 method per process / GPU (same --out);
                                                       # a final --resume run evaluates every method
  ... --noise mask                                     # the mask-token QwenDLM (the default preset's; h200: uniform)
  ... --tasks list_ops,arithmetic                      # train and evaluate on these tasks (default: the preset's)
  ... --skip-stage2 --export-package DIR               # stages 0-1, then the base as a small bf16 HF directory
  ... --base-package DIR                               # stage 2 (and eval) from such a base: no stages 0-1
A stage stopped by SIGTERM (or by --time-limit) saves its checkpoint and the run exits with status 75 before any
later stage or evaluation; `--resume` continues it.

Stages (each checkpointed with orbax under OUT/stage*/; a finished stage is reused, never recomputed; a larger
--orl-rounds continues a finished stage 2):
  tokenizer  byte-level BPE trained on the train split of the task suite (embedded default only)
  stage 0    AR pretraining of a small Qwen3-architecture model on the task corpus (the stand-in for Qwen3)
  stage 1    conversion AR -> QwenDLM with the block-diffusion objective (train/objectives.py)
  stage 2    ORL on-policy residual learning, and its no-AEC ablation (train/stage2.py, train/orl.py)
  eval       held-out accuracy / TPF / tokens/s of the AR model (greedy) and of each QwenDLM variant across decoding
             thresholds -> OUT/report.md, OUT/accuracy_vs_tpf.png, OUT/results.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orl_jax import runtime  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Recipe:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    seq_len: int  # stage-0 packed row length
    batch: int
    stage0_steps: int
    stage1_steps: int
    lr0: float
    lr1: float
    block_length: int
    train_examples: int  # per task
    eval_examples: int  # held-out examples (all tasks together)
    eval_max_new: int
    tasks: tuple[str, ...]
    # Decoding settings swept at evaluation: (max denoising steps per block, stop threshold[, entropy bound]).
    # Uniform family: the stop threshold is the mean-entropy confidence of the stable-and-confident rule, the
    # entropy bound (default 0.1) caps the summed entropy accepted per step; mask family: the fill threshold is
    # 1 - stop threshold. Fewer steps / looser thresholds trade accuracy for tokens per forward.
    eval_settings: tuple[tuple, ...]
    # stage 2 (ORL): rounds of `orl_prompts` train prompts x `orl_group` sampled responses, one update each
    orl_rounds: int = 10
    rcd_steps: int = 0  # the RCD baseline's updates (0: orl_rounds); each costs ~1/6 of an ORL round on the H200
    orl_prompts: int = 4
    orl_group: int = 4
    orl_states: int = 8  # replayed states per verified response
    orl_max_prompt: int = 192
    orl_steps: int = 8  # max denoising steps per block during rollouts (uniform family)
    orl_threshold: float = 0.9  # mask family: the rollouts' fill threshold
    # mask family: the rollouts' sampling temperature. At 1 ORL's anchor (reverse KL to the behaviour distribution,
    # one update per rollout) is exactly zero; below 1 it pulls confident positions towards the sharper tempered
    # distribution (train/orl.py). Not yet run on the GPU
    orl_temperature: float = 1.0
    # 0: every round draws fresh train prompts; N > 0: the rounds cycle through one fixed set of N train prompts
    # (epochs over a prompt set, so a model can be trained on its own answers to the same prompts again)
    orl_prompt_pool: int = 0
    lr2: float = 3e-4  # stage-2 peak rate (warmup: a tenth of the rounds); the h200 run diverged at 1e-4
    l_aec: float = 10.0  # weight of Adjacent Entropy Contraction in ORL's loss (ORLLossConfig.l_aec)
    # ORL's L_pred trains the positions whose behaviour normalized entropy is above this (ORLLossConfig.pred_gate).
    # 0.02 is ~0.965 confidence at vocab 2494: positions between that and a strict decoding threshold (0.999), the
    # ones that keep a block open there, get no L_pred gradient (only the anchor, zero at temperature 1)
    pred_gate: float = 0.02
    # weight of ORL's capped reverse-KL anchor on the confident positions (ORLLossConfig.l_anchor). Rolled out below
    # temperature 1 the anchor pulls those positions towards the sharper tempered policy: the term that acts on
    # the positions a strict threshold waits for (~0.004 per round at temperature 0.7, session 11)
    l_anchor: float = 1.0
    # stage 2: the adapter g_phi's learning rate as a multiple of lr2. Lower than the backbone's by our reading of
    # METHOD.md; the mask family's adapter starts untrained (zero output) and may want more
    adapter_lr_scale: float = 0.5
    # Compute dtype of every stage; the weights stay float32 (master copy) either way.
    compute_dtype: str = "float32"
    attention_impl: str = "orl_jax"  # training attention: orl_jax | xla | cudnn (ModelConfig.attention_impl)
    # stage-1 row length (whole examples packed, kept apart by the attention mask); 0 = seq_len. Longer examples are
    # left out of stage 1 and of the held-out set (whose reference answer must also fit eval_max_new).
    conv_len: int = 0
    remat: bool = False  # recompute each layer in the backward pass of stages 1-2 (long rows, two passes)
    eval_fit: bool = True  # False: evaluate the first held-out examples even when their answer cannot fit
    # QwenDLM reads each canvas position's logits from the row before it (ModelConfig.logit_shift, the AR shift of
    # Dream / Fast-dLLM v2): a block's first token is the AR model's own next-token prediction
    logit_shift: bool = True
    # stage 1 also trains the clean (causal) rows with stage 0's next-token loss, at this weight (0: off); +3-8
    # points on the h200 preset (benchmarks/results/2026-11-30_conversion_ar_loss_h200x2)
    ar_weight: float = 1.0
    # ORL: weight of the certainty-forcing term (ORLLossConfig.l_cert, our addition after dParallel: the entropy of
    # the positions whose argmax already is the verified token); 0 = the method as specified. On the h200 base it
    # bought TPF at a worse accuracy cost than a looser threshold (benchmarks/results/2026-12-02_orl_cert_h200/)
    l_cert: float = 0.0
    # ORL: weight of stage 1's conversion objective on a batch of ground-truth train rows in every update (our
    # addition, PPO-ptx style: a counterweight to ORL's steady drift from strict-decoding accuracy); 0 = off
    orl_sup_weight: float = 0.0
    # ORL: L_pred's reduction over a state's positions (ORLLossConfig.pred_norm): "state" (mean) or "block" (sum / L)
    pred_norm: str = "state"
    # QwenDLM's noise (--noise): "uniform" (uniform-state canvas, self-conditioning; our reading of QwenDLM) or "mask"
    # (LLaDA-style [MASK] tokens, threshold fill; the family of every ORL record since session 7)
    noise: str = "uniform"
    # ORL's states: "rollouts" (the method), or a diagnostic feeding ORL's replay and loss code states built from
    # ground-truth answers: "truth_random" (stage 1's random masks) or "truth_forced" (teacher-forced threshold
    # decoding); train/truth_states.py. Mask family only
    orl_source: str = "rollouts"
    # ORL: weigh each verified response by 1 - its prompt's verified share (ORLConfig.group_baseline; our addition)
    orl_group_baseline: bool = False
    # ORL: replay the captured states with their residual (the method); False zeroes it (ORLConfig.replay_residual)
    orl_replay_residual: bool = True


PRESETS = {
    # CPU, 2 cores (`make demo`): the whole recipe, stage 2 included, within 15 minutes on the slowest 2-core machine
    # seen (session 29's, ~1.7x slower than session 30's). A task this size learns in minutes: one operation on 3-5
    # digits (list_ops_short). The 2-layer, 192-wide model at 1e-2 copies its input after ~300-400 steps; session
    # 29's 4-layer, 128-wide one at 3e-3 had not after 600 and scored 0-4% on word problems and code. The mask
    # family's conversion costs a third of the uniform one's per step; rollouts fill at 0.995, the only threshold at
    # which this model's decoding verifies at all, so stage 2 has verified rollouts to update on
    # (benchmarks/results/2026-12-02_make_demo_list_task_cpu/).
    "default": Recipe(vocab_size=1024, hidden=192, layers=2, heads=6, kv_heads=2, head_dim=32, mlp=512, seq_len=192,
                      batch=16, stage0_steps=500, stage1_steps=60, lr0=1e-2, lr1=2e-3, block_length=16,
                      train_examples=20000, eval_examples=48, eval_max_new=64, tasks=("list_ops_short",),
                      eval_settings=((16, 0.005), (8, 0.05), (4, 0.3)), noise="mask", orl_prompts=8,
                      orl_threshold=0.995),
    # the test suite's end-to-end run: every stage real, everything tiny (seconds, not minutes)
    "smoke": Recipe(vocab_size=320, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, mlp=64, seq_len=384,
                    batch=4, stage0_steps=6, stage1_steps=4, lr0=3e-3, lr1=1e-3, block_length=8,
                    train_examples=40, eval_examples=4, eval_max_new=16, tasks=("arithmetic",),
                    eval_settings=((4, 0.3, 0.05),), orl_rounds=2, orl_prompts=2, orl_group=2, orl_states=4,
                    orl_max_prompt=320, orl_steps=4, eval_fit=False),
    # one H200, each stage well inside 10 minutes (cuDNN attention: 0.17 s per stage-1 step against 0.50 with
    # orl_jax's; the strictest eval setting probes the model near one token per step).
    # Stage 0 packs 512-token rows (98.9% of examples fit whole; attention cost grows with the row length).
    "h200": Recipe(vocab_size=4096, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, mlp=1536, seq_len=512,
                   batch=128, stage0_steps=1000, stage1_steps=2000, lr0=1e-3, lr1=5e-4, block_length=32,
                   train_examples=20000, eval_examples=256, eval_max_new=320,
                   tasks=("arithmetic", "list_ops", "program_output", "code_function"),
                   eval_settings=((32, 0.0005, 0.001), (32, 0.001, 0.01), (32, 0.005), (16, 0.02), (8, 0.1), (4, 0.3)),
                   orl_rounds=200, orl_prompts=16,
                   orl_group=8, orl_states=16, orl_max_prompt=256, orl_steps=32, lr2=1e-5,
                   compute_dtype="bfloat16", conv_len=512, remat=True, attention_impl="cudnn"),
}


# Recipe fields that a flag of the same name overrides: (type, help, valid values), declared and checked in one loop
NUMERIC_FLAGS = {
    "stage0_steps": (int, "stage-0 (AR pretraining) steps", "> 0"),
    "stage1_steps": (int, "stage-1 (conversion) steps", "> 0"),
    "orl_rounds": (int, "stage-2 rounds (ORL; RCD's updates too unless --rcd-steps); lowering it below a run's "
                        "saved round count ends that stage there, raising it continues a finished stage from its "
                        "last checkpoint", "> 0"),
    "rcd_steps": (int, "stage 2: the RCD baseline's updates (0: --orl-rounds); raising it continues a finished RCD "
                       "stage", ">= 0"),
    "orl_prompts": (int, "stage 2: prompts per ORL round", "> 0"),
    "orl_group": (int, "stage 2: sampled responses per prompt", "> 0"),
    "orl_prompt_pool": (int, "stage 2: cycle the rounds through a fixed set of this many train prompts (0: fresh "
                             "prompts every round)", ">= 0"),
    "orl_threshold": (float, "stage 2, mask family: the rollouts' fill threshold", "in (0, 1]"),
    "orl_temperature": (float, "stage 2, mask family: the rollouts' sampling temperature (below 1 the anchor "
                               "sharpens confident positions)", "in (0, 1]"),
    "lr2": (float, "stage-2 peak learning rate (ORL and RCD)", "in (0, 1)"),
    "l_aec": (float, "ORL's AEC loss weight (AEC values are ~1e-3)", ">= 0"),
    "pred_gate": (float, "ORL: L_pred trains positions whose behaviour normalized entropy is above this", ">= 0"),
    "l_anchor": (float, "ORL's anchor weight (capped reverse KL to the rollout's tempered policy on confident "
                 "positions)", ">= 0"),
    "adapter_lr_scale": (float, "stage 2: the adapter's learning rate as a multiple of --lr2", ">= 0"),
    "ar_weight": (float, "stage 1, RCD and ORL: weight of the next-token loss on the clean rows",
                  ">= 0"),
    "orl_sup_weight": (float, "ORL: weight of the conversion objective on ground-truth train rows in every update "
                              "(our addition, 0 = off)", ">= 0"),
    "l_cert": (float, "ORL: weight of certainty forcing (entropy of the unresolved positions already predicted "
                      "right; our addition, 0 = off)", ">= 0"),
}
VALID = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0, "in (0, 1]": lambda v: 0 < v <= 1,
         "in (0, 1)": lambda v: 0 < v < 1}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--hf-model", help="a real Qwen3 checkpoint directory (replaces the tokenizer and stage 0)")
    ap.add_argument("--out", default="outputs/train_qwendlm")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out")
    for name, (typ, what, valid) in NUMERIC_FLAGS.items():
        ap.add_argument("--" + name.replace("_", "-"), type=typ, help=f"{what} ({valid}); default: the preset's")
    ap.add_argument("--attention-impl", choices=["orl_jax", "xla", "cudnn"],
                    help="training attention (ModelConfig.attention_impl); default: the preset's")
    ap.add_argument("--logit-shift", action=argparse.BooleanOptionalAction,
                    help="QwenDLM's AR shift (ModelConfig.logit_shift); default: the preset's (on)")
    ap.add_argument("--tasks", metavar="NAME,...",
                    help="comma-separated tasks to train and evaluate on (orl_jax.data.tasks.TASKS); default: the "
                         "preset's")
    ap.add_argument("--noise", choices=["uniform", "mask"],
                    help="QwenDLM variant: uniform-state canvas or mask tokens; default: the preset's")
    ap.add_argument("--pred-norm", choices=["state", "block"],
                    help="ORL: L_pred per state as the mean over its uncertain positions (state) or their sum / the "
                         "block length (block); default: the preset's (state)")
    ap.add_argument("--orl-source", choices=["rollouts", "truth_random", "truth_forced", "truth_forced_verified"],
                    help="ORL's states: on-policy rollouts (the method, default) or, as a diagnostic, states built "
                         "from ground-truth answers (random masks, or teacher-forced decoding, of every example or "
                         "of those whose rollout verifies; --noise mask)")
    ap.add_argument("--orl-replay-residual", action=argparse.BooleanOptionalAction, default=None,
                    help="ORL: replay the rollouts' states with the residual they consumed (default); "
                         "--no-orl-replay-residual zeroes it, a diagnostic (the adapter then gets no gradient)")
    ap.add_argument("--orl-group-baseline", action="store_true", default=None,
                    help="ORL: weigh each verified response by 1 - its prompt's verified share, so prompts whose "
                         "responses all verify give no gradient (our addition; ORLConfig.group_baseline)")
    ap.add_argument("--skip-stage2", action="store_true", help="stop after the conversion (no ORL)")
    ap.add_argument("--residual-ablation", action="store_true",
                    help="also evaluate each stage-2 model decoding without its residual: what the residual adds, "
                         "apart from what stage 2's training did to the backbone")
    ap.add_argument("--export-package", metavar="DIR",
                    help="after stage 1, write the converted base and its tokenizer to the new directory DIR "
                         "(bfloat16 safetensors in shards of <= 15 MiB: orl_jax/train/base_package.py)")
    ap.add_argument("--base-package", metavar="DIR",
                    help="start from a base package (--export-package) instead of stages 0-1; later --resume runs "
                         "of the same --out reuse it")
    ap.add_argument("--stage2-methods", default="orl,noaec,rcd",
                    help="comma-separated stage-2 methods to train: orl, noaec (ORL without AEC), rcd, orl_rcd (ORL "
                         "rounds on the RCD model in RCD's residual form; trains rcd first if needed). Separate "
                         "processes (one GPU each, same --out, --resume, --no-eval) can train them side by side")
    ap.add_argument("--time-limit", type=float, metavar="MINUTES",
                    help="stop a training stage once this many minutes have passed since the start, as on SIGTERM "
                         "(checkpoint, exit 75; continue with --resume). The evaluation is not interrupted")
    ap.add_argument("--no-eval", action="store_true",
                    help="stop after training; a later --resume run evaluates (reusing every exported stage)")
    ap.add_argument("--distributed", action="store_true",
                    help="join a multi-host job (jax.distributed.initialize; cluster from the environment or the "
                         "--coordinator/--num-processes/--process-id flags); each host reads its share of the data")
    ap.add_argument("--coordinator", help="host:port of process 0 (with --distributed)")
    ap.add_argument("--num-processes", type=int)
    ap.add_argument("--process-id", type=int)
    ap.add_argument("--seed", type=int, default=0, help="training randomness (data order, noise, rollouts)")
    ap.add_argument("--eval-seed", type=int, default=0,
                    help="which held-out examples are drawn, apart from --seed: runs of different --seed are "
                         "evaluated on the same examples")
    args = ap.parse_args(argv)
    methods = [m for m in args.stage2_methods.split(",") if m]
    unknown = sorted(set(methods) - set(STAGE2_METHODS))
    if unknown or not methods:
        ap.error(f"--stage2-methods: unknown {unknown or 'empty list'}; choose from {', '.join(STAGE2_METHODS)}")
    args.stage2_methods = tuple(m for m in STAGE2_METHODS if m in methods)
    args.noise = args.noise or PRESETS[args.preset].noise
    if args.tasks is not None:
        from orl_jax.data.tasks import task_names

        try:
            args.tasks = tuple(dict.fromkeys(task_names([t for t in args.tasks.split(",") if t])))
        except ValueError as e:
            ap.error(f"--tasks {args.tasks!r}: {e}")
    for name, (_, _, valid) in NUMERIC_FLAGS.items():  # NaN fails every check
        v = getattr(args, name)
        if v is not None and not VALID[valid](v):
            ap.error(f"--{name.replace('_', '-')} must be {valid}, got {v}")
    if args.time_limit is not None and not args.time_limit > 0:
        ap.error(f"--time-limit must be a positive number of minutes, got {args.time_limit}")
    if args.time_limit is not None and args.distributed:  # each host's clock would stop it at another step
        ap.error("--time-limit is per process: with --distributed, stop the job with the scheduler's preemption "
                 "(orbax's preemption sync point) instead")
    if args.base_package is not None:
        if args.hf_model is not None:
            ap.error("--base-package replaces stages 0-1, --hf-model stage 0: pass one")
        from orl_jax.train.base_package import check_package

        try:
            check_package(args.base_package)
        except ValueError as e:
            ap.error(str(e))
    if args.orl_source not in (None, "rollouts") and args.noise != "mask":
        ap.error(f"--orl-source {args.orl_source} builds mask-family states: it needs --noise mask")
    if args.residual_ablation and (args.skip_stage2 or args.no_eval):
        ap.error("--residual-ablation adds evaluation rows of the stage-2 models: it has nothing to do with "
                 f"{'--skip-stage2' if args.skip_stage2 else '--no-eval'}")
    if args.export_package is not None and Path(args.export_package).exists():
        ap.error(f"--export-package {args.export_package!r} exists: the package goes to a new directory")
    args.deadline = None if args.time_limit is None else time.monotonic() + 60 * args.time_limit
    return args


STAGE2_METHODS = ("orl", "noaec", "rcd", "orl_rcd")  # orl_rcd: not in the default list (see stage2.stage2)
EXIT_STOPPED = 75  # a stage was stopped (SIGTERM) and checkpointed: run again with --resume (sysexits' TEMPFAIL)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.resume:
        raise SystemExit(f"{out} is not empty: pass --resume to continue it, or choose another --out")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    runtime.configure(out / "xla_cache")
    if args.distributed:
        runtime.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    import jax

    from orl_jax.decode.residual import NoResidual  # after runtime.configure: JAX starts there
    from orl_jax.train import stages

    # every flag named after a Recipe field overrides the preset's value when given
    r = dataclasses.replace(PRESETS[args.preset], **{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)
                                                     if getattr(args, f.name, None) is not None})
    if r.attention_impl == "cudnn" and jax.default_backend() != "gpu":
        if created:
            shutil.rmtree(out)  # nothing of this run is left behind
        raise SystemExit(f"--attention-impl cudnn (the {args.preset} preset's) needs an NVIDIA GPU; this backend is "
                         f"{jax.default_backend()!r}: pass --attention-impl orl_jax")
    tmp = out / f".recipe.json.{os.getpid()}"  # atomic: processes sharing --out may write it at once
    tmp.write_text(json.dumps(vars(args) | dataclasses.asdict(r), indent=2, default=str))  # resolved values win
    os.replace(tmp, out / "recipe.json")
    t0 = time.perf_counter()
    from orl_jax.train.base_package import export_package, imported_from

    try:
        if args.base_package is not None or imported_from(out):
            try:
                tok, dlm_cfg, dlm_params = stages.imported_base(r, args, out, log)
            except ValueError:  # a package of another model: nothing of this run is left behind
                if created:
                    shutil.rmtree(out)
                raise
            ar_cfg = ar_params = None
        else:
            try:
                tok, ar_cfg, ar_params = stages.base_model(r, args, out, log)
            except stages.HeldoutDoesNotFit:  # raised before stage 0 trains: nothing of this run is left behind
                if created:
                    shutil.rmtree(out)
                raise
            dlm_cfg, dlm_params = stages.convert(r, args, out, tok, ar_cfg, ar_params, log)
        if args.export_package is not None:
            export_package(args.export_package, dlm_cfg, dlm_params, out / "tokenizer")
            log(f"base package: {args.export_package}")
        methods = {"QwenDLM": (dlm_params, NoResidual())}  # its adapter is untrained: it decodes without one
        if not args.skip_stage2:
            from orl_jax.train.stage2 import stage2

            methods |= stage2(r, args, out, tok, dlm_cfg, dlm_params, log, args.stage2_methods)
            if args.residual_ablation:  # each stage-2 model again, decoding without its residual
                methods |= {name + stages.RESIDUAL_OFF: (params, NoResidual())
                            for name, (params, _) in list(methods.items()) if name != "QwenDLM"}
    except stages.StageStopped as e:
        log(str(e))
        raise SystemExit(EXIT_STOPPED) from None
    if args.no_eval:
        log("training done (--no-eval): evaluate with a later --resume run")
        return
    stages.evaluate_all(r, args, out, tok, ar_cfg, ar_params, dlm_cfg, methods, log, started=t0)


if __name__ == "__main__":
    main()
