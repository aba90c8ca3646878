"""The stages of recipes/train_qwendlm.py: tokenizer + AR base model (stage 0), AR -> QwenDLM conversion
(stage 1), and the held-out evaluation report. Each training stage checkpoints with orbax (train/ckpt.py) and
exports its final params (checkpoint.save_params) to OUT/stageN/params; a stage whose export exists is loaded,
not retrained, so `--resume` continues a killed run wherever it stopped.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from orl_jax import checkpoint
from orl_jax import params as P
from orl_jax.config import ModelConfig, from_hf_config, to_hf_config
from orl_jax.data import tasks
from orl_jax.data.embedded_tokenizer import task_corpus, train_tokenizer
from orl_jax.data.pipeline import make_dataset
from orl_jax.data.prompt_format import format_example, stop_token_ids
from orl_jax.data.tokenizer import load_tokenizer
from orl_jax.decode.residual import ORLResidual
from orl_jax.decode.samplers import MaskSampler, UniformSampler
from orl_jax.model import qwen3
from orl_jax.sharding import make_mesh
from orl_jax.train import base_package
from orl_jax.train.ckpt import CheckpointManager, latest_saved_step
from orl_jax.train.evaluate import evaluate, write_report
from orl_jax.train.loop import resume, train
from orl_jax.train.metrics import MetricsWriter
from orl_jax.train.objectives import DiffusionObjective, causal_lm_loss
from orl_jax.train.optim import OptimConfig, ParamGroup, make_optimizer
from orl_jax.train.step import make_train_step


def _examples(r, split: str, n_per_task: int, seed: int):
    return tasks.sample(split, n_per_task * len(r.tasks), seed, tasks=list(r.tasks))


def _encode(tok, examples, max_len: int, block: int = 0):
    """Rows of prompt + response ids (cut at max_len) and their prompt_mask. block > 0: the response is filled up
    to a whole number of blocks with its end-of-turn token, so the last block trains what the engine's last
    block holds after the answer ends (without it, no block ever shows a position past the end of turn)."""
    rows = []
    for ex in examples:
        prompt, response = format_example(tok, ex)
        if block:
            response = response + response[-1:] * (-len(response) % block)
        ids = (prompt + response)[:max_len]
        rows.append({"tokens": np.asarray(ids, np.int32),
                     "prompt_mask": (np.arange(len(ids)) < len(prompt)).astype(np.int32)})
    return rows


# the residual pathway learns in its own group: lower rate, own clipping (METHOD.md §3)
ADAPTER_GROUP = {"adapter": ParamGroup(lr_scale=0.5, clip_norm=1.0)}


def conv_len(r) -> int:
    return r.conv_len or r.seq_len


def conversion_data(r, tok, seed: int):
    """Packed rows of conv_len tokens (several whole train examples each; prompt_mask marks the prompts) for the
    block-diffusion objective, which keeps the examples of a row apart (objectives.packed_diffusion_mask).
    Responses end on a block boundary (filled with end-of-turn tokens, see _encode). Examples longer than a row are
    left out, never truncated (a cut answer teaches nothing)."""
    n = conv_len(r)
    examples = _examples(r, "train", r.train_examples, seed)
    rows = [x for x in _encode(tok, examples, n + 1, r.block_length) if len(x["tokens"]) <= n]
    return make_dataset(rows, seq_len=n, batch_size=r.batch, seed=seed)


DIFFUSION_BATCH_KEYS = ("tokens", "segment_ids", "positions", "prompt_mask")  # what diffusion_loss_fn reads


def diffusion_loss_fn(obj: DiffusionObjective, cfg, with_reference: bool = False):
    """loss_fn(params, batch, key) of the block-diffusion objective on conversion_data batches; with_reference:
    loss_fn(params, batch, key, reference_params) (RCD: residuals from a frozen model, passed in each step)."""

    def loss_fn(p, b, key, reference=None):
        batch = {k: b[k] for k in DIFFUSION_BATCH_KEYS}
        return obj.loss(p, cfg, batch, key, reference_params=reference)

    return loss_fn if with_reference else (lambda p, b, key: loss_fn(p, b, key))


class StageStopped(Exception):
    """A training stage stopped before its last step (SIGTERM / preemption): its checkpoint is saved, nothing is
    exported, and the later stages must not run on its unfinished params. `--resume` continues it."""

    def __init__(self, name: str, step: int, steps: int):
        super().__init__(f"{name} stopped at step {step} of {steps} (checkpoint saved): rerun with --resume")
        self.name, self.step, self.steps = name, step, steps


def check_same_model(saved: ModelConfig, cfg: ModelConfig, where: Path) -> None:
    """A resumed or reused stage must be the model this run asks for (a flag changed between runs)."""
    for field in ("noise", "block_length", "logit_shift", "adapter_hidden"):
        if getattr(saved, field) != getattr(cfg, field):
            raise ValueError(f"{where} was trained with {field}={getattr(saved, field)!r}, this run asks for "
                             f"{getattr(cfg, field)!r}: pass the flags of the run that made it (or another --out)")


def load_export(name: str, out: Path, cfg, log, continue_to: int | None = None):
    """The params a finished stage exported to OUT/name/params, or None. With `continue_to` (stage 2, whose rate
    is constant after its warmup) None also when the stage's checkpoints stop before that step: a larger
    --orl-rounds continues a finished stage from its last checkpoint instead of reusing its export."""
    export = out / name / "params"
    if not export.exists():
        return None
    step = latest_saved_step(out / name / "ckpt") if continue_to is not None else None
    if step is not None and step < continue_to:
        log(f"{name}: continuing from step {step} to {continue_to}")
        return None
    saved, params = checkpoint.load_params(export, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    check_same_model(saved, cfg, export)
    log(f"{name}: reusing {export}")
    return params


def _run_stage(name, out: Path, cfg, init_params, loss_fn, optim: OptimConfig, make_data, steps: int, log,
               frozen=None, deadline: float | None = None, continue_finished: bool = False):
    """Train `init_params()` with `loss_fn` for `steps` updates (resuming OUT/name/ckpt if present); export the result.
    init_params and make_data are callables, run only when the stage is not exported yet (building a stage's dataset
    tokenizes its whole train split). frozen: params of a frozen model of the same config, passed to
    loss_fn(params, batch, key, frozen). deadline: time.monotonic() at which the stage stops as on SIGTERM.
    continue_finished: a finished stage whose checkpoints stop before `steps` trains on (load_export)."""
    done = load_export(name, out, cfg, log, continue_to=steps if continue_finished else None)
    if done is not None:
        return done
    model_file = out / name / "model_config.json"  # what the checkpoints under OUT/name/ckpt train
    if model_file.exists():
        check_same_model(from_hf_config(json.loads(model_file.read_text()), cfg.dtype), cfg, out / name)
    else:
        model_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = model_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(to_hf_config(cfg), indent=1))
        tmp.replace(model_file)
    params, data = init_params(), make_data()
    export = out / name / "params"
    mesh = make_mesh(data=1, fsdp=-1, tensor=1)
    specs = qwen3.param_specs(cfg)
    step = make_train_step(loss_fn, make_optimizer(optim), mesh, specs,
                           frozen_specs=None if frozen is None else specs)
    if frozen is not None:
        step = step.bind(frozen)
    it = iter(data)
    with (CheckpointManager(out / name / "ckpt", max_to_keep=2, deadline=deadline) as ck,
          MetricsWriter(out / name / "logs") as w):
        state = resume(ck, step.abstract_state(jax.random.key(1)), it)
        if state is None:
            state = step.init_state(params, jax.random.key(1))
        else:
            log(f"{name}: resumed at step {int(state.step)}")
        try:
            state = train(state, step, it, num_steps=steps, ckpt=ck, save_every=max(steps // 4, 1),
                          log_every=max(steps // 20, 1), writer=w)
        finally:
            it.close()  # stops the prefetch thread now, not at interpreter exit
    if int(state.step) < steps:
        raise StageStopped(name, int(state.step), steps)
    params = jax.device_get(state.params)
    checkpoint.save_params(export, cfg, params, overwrite=True)  # a continued stage replaces its export
    last = (out / name / "logs" / "metrics.jsonl").read_text().splitlines()[-1:] or ["-"]
    log(f"{name}: done at step {int(state.step)}; last metrics {last[0]}")
    return params


def base_model(r, args, out: Path, log):
    """(tokenizer, AR config, AR params): a real Qwen3 checkpoint, or the embedded tokenizer + stage 0."""
    if args.hf_model:
        from orl_jax.convert.hf import load_hf

        cfg, params = load_hf(args.hf_model, dtype="bfloat16")
        tok = load_tokenizer(args.hf_model)
        cfg = cfg.replace(eos_token_ids=stop_token_ids(tok), mask_token_id=tok.mask_token_id,
                          attention_impl=r.attention_impl)
        log(f"loaded {args.hf_model}: {sum(x.size for x in jax.tree.leaves(params)) / 1e9:.2f} B params")
        return tok, cfg, params
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        train_tokenizer(task_corpus(n_per_task=min(r.train_examples, 1000), tasks=list(r.tasks)), r.vocab_size,
                        tok_dir)
    tok = load_tokenizer(tok_dir)
    run_heldout(r, args, tok)  # a preset whose held-out examples do not fit fails here, not after training
    cfg = ar_config(r, tok)
    log(f"stage 0: AR pretraining, {P.count(qwen3.param_specs(cfg)) / 1e6:.2f} M params, vocab {cfg.vocab_size}")
    params = _run_stage("stage0", out, cfg, lambda: P.init(qwen3.param_specs(cfg), jax.random.key(args.seed)),
                        lambda p, b, k: causal_lm_loss(p, cfg, b), ar_optim(r),
                        lambda: make_dataset(ar_rows(r, tok, args.seed), seq_len=r.seq_len, batch_size=r.batch,
                                             seed=args.seed),
                        r.stage0_steps, log, deadline=args.deadline)
    return tok, cfg, params


def ar_config(r, tok) -> ModelConfig:
    """The embedded stage-0 model: the recipe's Qwen3 shape, float32 master weights, compute in r.compute_dtype."""
    return ModelConfig(vocab_size=len(tok), hidden_size=r.hidden, num_layers=r.layers, num_heads=r.heads,
                       num_kv_heads=r.kv_heads, head_dim=r.head_dim, intermediate_size=r.mlp,
                       max_position_embeddings=4096, dtype=r.compute_dtype, param_dtype="float32",
                       attention_impl=r.attention_impl, tie_word_embeddings=True,
                       eos_token_ids=stop_token_ids(tok), pad_token_id=tok.pad_token_id,
                       mask_token_id=tok.mask_token_id, block_length=r.block_length)


def ar_rows(r, tok, seed: int) -> list[dict]:
    """Stage-0 examples (every token a target), to be packed into r.seq_len rows."""
    return [{"tokens": x["tokens"], "loss_mask": np.ones_like(x["tokens"])}
            for x in _encode(tok, _examples(r, "train", r.train_examples, seed), r.seq_len)]


def ar_optim(r) -> OptimConfig:
    return OptimConfig(lr=r.lr0, warmup_steps=max(r.stage0_steps // 20, 1), total_steps=r.stage0_steps)


def dlm_config(r, args, ar_cfg: ModelConfig) -> ModelConfig:
    """The QwenDLM that stage 1 makes of the AR model `ar_cfg`: its adapter, block, noise and logit shift."""
    if args.noise == "mask" and ar_cfg.mask_token_id is None:
        raise ValueError("--noise mask needs a tokenizer with a mask token")
    return ar_cfg.replace(adapter_hidden=ar_cfg.hidden_size, block_length=r.block_length, noise=args.noise,
                          logit_shift=r.logit_shift)


def imported_base(r, args, out: Path, log):
    """(tokenizer, QwenDLM config, params) of a base package (train/base_package.py): from --base-package on the
    first run, then from the run's own stage-1 export. Stages 0-1 are not run."""
    before = base_package.imported_from(out)
    if before and args.base_package and Path(args.base_package).resolve() != Path(before):
        raise ValueError(f"{out} was started from the base package {before}, not {args.base_package}")
    source, fresh = before or args.base_package, before is None
    if fresh and (out / "stage1").exists():
        raise ValueError(f"{out} has its own stage 1: a base package starts a new --out")
    tok = load_tokenizer(base_package.check_package(source) if fresh else out / "tokenizer")
    run_heldout(r, args, tok)  # before anything is installed or trained
    cfg = dlm_config(r, args, ar_config(r, tok))
    if fresh:
        saved, params = base_package.read_package(source)
        check_same_model(saved, cfg, Path(source))
        P.check_tree(params, qwen3.param_specs(cfg), where=str(source))
        base_package.install(source, out, cfg, params)
        log(f"stages 0-1: imported the base package {source} ({P.count(qwen3.param_specs(cfg)) / 1e6:.2f} M params)")
        return tok, cfg, params
    return tok, cfg, load_export("stage1", out, cfg, log)


def convert(r, args, out: Path, tok, ar_cfg: ModelConfig, ar_params, log):
    """Stage 1: the AR model + a zero-initialized adapter g_phi, trained with the block-diffusion objective."""
    cfg = dlm_config(r, args, ar_cfg)

    def params():  # the AR model + a fresh adapter (only when stage 1 is not exported yet)
        adapter = P.init(qwen3.param_specs(cfg)["adapter"], jax.random.key(args.seed + 1))
        return dict(jax.tree.map(jnp.asarray, ar_params), adapter=adapter)

    loss_fn = diffusion_loss_fn(DiffusionObjective(block_length=r.block_length, remat=r.remat, ar_weight=r.ar_weight),
                                 cfg)
    # Self-conditioning only applies to the uniform family; the mask family's adapter waits for ORL (stage 2).
    optim = OptimConfig(lr=r.lr1, warmup_steps=max(r.stage1_steps // 20, 1), total_steps=r.stage1_steps,
                        groups=ADAPTER_GROUP)
    log(f"stage 1: conversion to QwenDLM ({args.noise} noise, block {r.block_length}, logit shift "
        f"{'on' if r.logit_shift else 'off'})")
    return cfg, _run_stage("stage1", out, cfg, params, loss_fn, optim,
                           lambda: conversion_data(r, tok, args.seed + 1), r.stage1_steps, log, deadline=args.deadline)


class HeldoutDoesNotFit(ValueError):
    """Too few held-out examples fit the preset's budgets: raised as soon as the tokenizer exists, before training."""


def run_heldout(r, args, tok):
    """The run's held-out examples (drawn with --eval-seed, not --seed: runs of different seeds see the same ones)."""
    return heldout_examples(r, tok, args.eval_seed + 7)  # until session 29: args.seed + 7 (same set at seed 0)


def heldout_examples(r, tok, seed: int):
    """r.eval_examples held-out examples whose reference fits the budgets: answer <= eval_max_new tokens and
    prompt + answer <= conv_len (what stage 1 trains on). Drawn in order from a larger reproducible sample."""
    pool = tasks.sample("heldout", 2 * r.eval_examples, seed, tasks=list(r.tasks))
    if not r.eval_fit:  # the smoke preset's tiny budgets: the first examples, fitting or not
        return pool[:r.eval_examples]
    fits = []
    for ex in pool:
        prompt, response = format_example(tok, ex)
        if len(response) <= r.eval_max_new and len(prompt) + len(response) <= conv_len(r):
            fits.append(ex)
    if len(fits) < r.eval_examples:
        raise HeldoutDoesNotFit(f"only {len(fits)} of {len(pool)} held-out examples fit eval_max_new="
                                f"{r.eval_max_new} and conv_len={conv_len(r)}; raise them")
    return fits[:r.eval_examples]


def _brief(row) -> dict:
    """An evaluation row for the log, without its per-example hits."""
    return {k: v for k, v in dataclasses.asdict(row).items() if k != "hits"}


# Suffix of an evaluation row that decodes a stage-2 model without its residual (the recipe's --residual-ablation):
# what the residual adds at decoding, apart from what the extra training did to the backbone
RESIDUAL_OFF = ", residual off"


def evaluate_all(r, args, out: Path, tok, ar_cfg, ar_params, dlm_cfg, methods: dict, log, started: float):
    """AR greedy baseline, then every QwenDLM variant in `methods` at every decoding setting.

    methods: {name: (params, residual)}, the residual a mask-family model was trained with (the uniform family
    decodes with self-conditioning, ORLResidual, except rows named with RESIDUAL_OFF: no residual in either
    family)."""
    import time

    examples = run_heldout(r, args, tok)
    rows = []
    if ar_params is not None:  # None: stage 2 from an imported base package, no stage-0 model here
        rows.append(evaluate(ar_params, ar_cfg, tok, examples, method="AR (greedy)", setting="-", ar=True,
                             max_new_tokens=r.eval_max_new))
        log(f"eval AR: {_brief(rows[-1])}")
    if dlm_cfg.prefix_attention == "causal" and (dlm_cfg.logit_shift or r.ar_weight > 0):
        # the converted weights decoded token by token (their clean rows are trained as the causal model): what
        # the conversion kept of the AR model, after stage 1's extra training
        rows.append(evaluate(methods["QwenDLM"][0], dlm_cfg, tok, examples, method="QwenDLM weights, AR decoding",
                             setting="-", ar=True, max_new_tokens=r.eval_max_new))
        log(f"eval QwenDLM as AR: {_brief(rows[-1])}")
    for method, (params, mask_residual) in methods.items():
        for steps, thr, *bound in r.eval_settings:
            if dlm_cfg.noise == "uniform":
                default = UniformSampler.entropy_bound
                bound = bound[0] if bound else default
                kw = dict(sampler=UniformSampler(max_denoising_steps=steps, confidence=thr, entropy_bound=bound,
                                                 greedy=True),
                          residual=mask_residual if method.endswith(RESIDUAL_OFF) else ORLResidual())
                setting = f"steps<={steps}, confidence={thr}" + (f", entropy bound={bound}" if bound != default else "")
            else:
                kw = dict(sampler=MaskSampler(mask_token_id=dlm_cfg.mask_token_id, threshold=max(1 - thr, 0.05)),
                          max_steps=steps, residual=mask_residual)
                setting = f"steps<={steps}, fill threshold={max(1 - thr, 0.05):.4g}"  # 0.9995, not 1.00
            rows.append(evaluate(params, dlm_cfg, tok, examples, method=method, setting=setting,
                                 max_new_tokens=r.eval_max_new, **kw))
            log(f"eval {method} {setting}: {_brief(rows[-1])}")
    imported = base_package.imported_from(out)
    source = f" from {args.hf_model}" if args.hf_model else f" from the base package {imported}" if imported else ""
    notes = [f"Preset `{args.preset}`{source}; "
             f"{len(examples)} held-out examples of {', '.join(r.tasks)} (those whose reference answer fits "
             f"{r.eval_max_new} new tokens and {conv_len(r)} tokens with its prompt); max {r.eval_max_new} new "
             f"tokens; compute in {r.compute_dtype}, float32 master weights.",
             f"QwenDLM: {dlm_cfg.noise} noise, block {r.block_length}, logit shift "
             f"{'on' if dlm_cfg.logit_shift else 'off'}; uniform family: greedy proposals, entropy "
             "bound 0.1, self-conditioning residual (ORLResidual); mask family: threshold fill, residual as "
             f"trained (base: none, ORL: ORLResidual, RCD: RCDResidual; rows ending '{RESIDUAL_OFF}': that model "
             "without any residual, in either family). TPF counts "
             "denoising and commit forwards; tokens/s is the batched decode after compilation.",
             f"Run time of this process: {time.perf_counter() - started:.0f} s on {jax.devices()[0].device_kind} "
             "(a resumed run counts only its last call)."]
    for name in ("stage2_orl", "stage2_orl_noaec"):
        log_file = out / name / "logs" / "metrics.jsonl"
        if log_file.exists():
            ms = [json.loads(line) for line in log_file.read_text().splitlines()]
            updates = sum("loss" in m for m in ms)
            notes.append(f"{name}: {len(ms)} rounds, mean verified share {np.mean([m['verified'] for m in ms]):.2f}, "
                         f"{updates} updates (a round whose responses all fail verification gives no gradient).")
    path = write_report(rows, out, "AR -> QwenDLM conversion (held-out)", notes, base="QwenDLM")
    log(f"report: {path}")
