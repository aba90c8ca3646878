"""Stage 2 of recipes/train_qwendlm.py: ORL (on-policy residual learning) on the converted QwenDLM, and its
no-AEC ablation, each a sequence of rounds (rollout -> verify -> replay -> one update; train/orl.py).

Prompts of round k are drawn from the train split with seed k (or, with r.orl_prompt_pool = N, are prompts
kP .. kP + P - 1 mod N of one fixed set), rollout keys are fold_in(key, k), and the round counter is checkpointed
with the state, so `--resume` replays exactly the rounds that were not done yet. A larger --orl-rounds on a
finished stage continues it from its last checkpoint (the rate is constant after a warmup of at most WARMUP_MAX
updates, so a run grown over several calls trains as one long run would, but for that warmup's length).
The RCD baseline trains the same converted model off-policy: the block-diffusion objective on randomly noised
training states, with the residual computed by the frozen converted model (DiffusionObjective(reference_params))
and plain cross-entropy, for r.rcd_steps updates (default: as many as ORL takes rounds). The frozen reference is
a sharded argument of the jitted step (TrainStep.bind), never constants baked into it.
Both RCD and ORL keep the conversion's next-token term on clean rows (r.ar_weight, as stage 1 trained the base;
ORLLossConfig.ar_weight): without it, RCD at 1e-4 from the h200 base lost 3-10 points of held-out accuracy at
five of six settings, its residual on or off; with it, it was +0.8 to +5.5 points
(benchmarks/results/2026-12-02_rcd_ar_term_h200/). It did not keep ORL at 3e-5 from losing 9-13 points.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from pathlib import Path

import jax
import numpy as np

from orl_jax import checkpoint
from orl_jax.data import tasks
from orl_jax.data.prompt_format import decode_response, format_example, format_prompt, stop_token_ids
from orl_jax.decode.residual import ORLResidual, RCDResidual
from orl_jax.decode.samplers import MaskSampler, UniformSampler
from orl_jax.model import qwen3
from orl_jax.sharding import make_mesh
from orl_jax.train.ckpt import CheckpointManager
from orl_jax.train.metrics import MetricsWriter
from orl_jax.train.objectives import DiffusionObjective
from orl_jax.train.optim import OptimConfig, make_optimizer
from orl_jax.train.orl import ORLConfig, make_orl_loss, orl_iteration, replay_update, rollout, selection_rng
from orl_jax.train.orl_losses import ORLLossConfig
from orl_jax.train.replay import build_replay
from orl_jax.train.stages import (
    ADAPTER_GROUP,
    DIFFUSION_BATCH_KEYS,
    StageStopped,
    _run_stage,
    conversion_data,
    diffusion_loss_fn,
    load_export,
)
from orl_jax.train.step import make_train_step
from orl_jax.train.truth_states import forced_capture, make_forced_step, random_mask_capture

WARMUP_MAX = 20  # stage 2's longest warmup, in updates (every run so far had <= 200 rounds: <= 20)


def rcd_steps(r) -> int:
    """The RCD baseline's update count: r.rcd_steps, or as many as ORL takes rounds."""
    return r.rcd_steps or r.orl_rounds


def stage2_optim(r, steps: int | None = None) -> OptimConfig:
    """ORL's and RCD's optimizer: r.lr2, no weight decay, the adapter group (r.adapter_lr_scale times the rate, its
    own clipping), a warmup of a tenth of the updates, then a constant rate (min_lr_ratio=1).

    The warmup: the optimizer starts with fresh moments, and an Adam step at the full rate on one round's noisy
    gradient moves every weight by ~lr; at lr 1e-4 without warmup the H200 run's policy lost its verified share
    within 60 rounds (benchmarks/results/2026-11-29_train_qwendlm_h200x4). The constant rate: with a cosine to
    a tenth, the 1e-5 run spent half of its 100 rounds below 5e-6, and ORL moved TPF by 5%
    (benchmarks/results/2026-11-29_train_qwendlm_h200x2). The warmup is capped at WARMUP_MAX rounds, so a run
    continued to more rounds (load_export) never falls back into a longer warmup."""
    steps = r.orl_rounds if steps is None else steps
    warmup = min(max(steps // 10, 1), WARMUP_MAX)
    return OptimConfig(lr=r.lr2, warmup_steps=warmup, total_steps=max(steps, 1),
                       min_lr_ratio=1.0, weight_decay=0.0,
                       groups={"adapter": dataclasses.replace(ADAPTER_GROUP["adapter"], lr_scale=r.adapter_lr_scale)})


def train_prompts(r, tok, max_prompt: int, n: int, seed: int) -> list:
    """n train examples (of r.tasks, drawn with `seed`) whose formatted prompt fits max_prompt tokens."""
    pool = tasks.sample("train", 4 * n, seed, tasks=list(r.tasks))
    exs = [ex for ex in pool if len(format_prompt(tok, ex.prompt)) <= max_prompt][:n]
    if len(exs) < n:
        raise ValueError(f"too few train prompts fit ORL max_prompt={max_prompt} tokens ({len(exs)} of {n})")
    return exs


def round_examples(r, tok, max_prompt: int):
    """rnd -> the r.orl_prompts train examples of ORL round rnd: fresh ones (seed 100000 + rnd), or with
    r.orl_prompt_pool = N the next ones of a fixed set of N, cycled (the set is built once: 1024 prompts take
    ~2 s, as long as a round)."""
    P = r.orl_prompts
    if not r.orl_prompt_pool:
        return lambda rnd: train_prompts(r, tok, max_prompt, P, 100_000 + rnd)
    fixed = train_prompts(r, tok, max_prompt, r.orl_prompt_pool, 99_999)
    return lambda rnd: [fixed[(rnd * P + i) % len(fixed)] for i in range(P)]


def run_orl(name: str, r, args, out: Path, tok, cfg, params, loss_cfg: ORLLossConfig, log, residual=None):
    """Train `params` with ORL for r.orl_rounds rounds (rollouts and replay in the `residual` form); export to
    OUT/name/params (reused when present, continued when its checkpoints stop before r.orl_rounds)."""
    done = load_export(name, out, cfg, log, continue_to=r.orl_rounds)
    if done is not None:
        return done
    G, P = r.orl_group, r.orl_prompts
    ocfg = ORLConfig(group_size=G, max_new_tokens=r.eval_max_new, max_states=r.orl_states,
                     max_prompt=r.orl_max_prompt, loss=loss_cfg, residual=residual or ORLResidual(),
                     group_baseline=r.orl_group_baseline, replay_residual=r.orl_replay_residual)
    # sampled proposals: the policy explores. Mask family: sampled at r.orl_temperature (default 1), filled above
    # r.orl_threshold
    sampler = (UniformSampler(max_denoising_steps=r.orl_steps) if cfg.noise == "uniform" else
               MaskSampler(mask_token_id=cfg.mask_token_id, threshold=r.orl_threshold,
                           temperature=r.orl_temperature))
    optim = stage2_optim(r)
    # r.orl_sup_weight > 0 (our addition): each update also trains stage 1's conversion objective on a batch of
    # ground-truth train rows (make_orl_loss(supervised=...)). Its data order restarts on --resume (approximate).
    sup, sup_rows = None, None
    if r.orl_sup_weight:
        obj = DiffusionObjective(block_length=r.block_length, remat=r.remat, ar_weight=r.ar_weight)
        sup = (diffusion_loss_fn(obj, cfg), r.orl_sup_weight)
        sup_rows = iter(conversion_data(r, tok, args.seed + 5))
    step = make_train_step(make_orl_loss(cfg, sampler, G * P, loss_cfg, ocfg.residual, remat=r.remat,
                                         supervised=sup),
                           make_optimizer(optim),
                           make_mesh(data=1, fsdp=-1, tensor=1), qwen3.param_specs(cfg))
    stops = stop_token_ids(tok)
    key = jax.random.key(args.seed + 2)
    with (CheckpointManager(out / name / "ckpt", max_to_keep=2, deadline=args.deadline) as ck,
          MetricsWriter(out / name / "logs") as w,
          contextlib.closing(sup_rows) if sup_rows is not None else contextlib.nullcontext()):  # its prefetch thread
        restored = ck.restore_latest(step.abstract_state(jax.random.key(2)))
        state, start = (restored[0], int(restored[1]["round"])) if restored else (
            step.init_state(params, jax.random.key(2)), 0)
        examples = round_examples(r, tok, ocfg.max_prompt)
        truth_round = None if r.orl_source == "rollouts" else truth_states_round(r, tok, cfg, ocfg, sampler)
        for rnd in range(start, r.orl_rounds):
            rows = None if sup_rows is None else {k: v for k, v in next(sup_rows).items() if k in DIFFUSION_BATCH_KEYS}
            if truth_round is not None:
                state, m, _ = truth_round(state, step, rnd, jax.random.fold_in(key, rnd), rows)
            else:
                exs = examples(rnd)
                prompts = [format_prompt(tok, ex.prompt) for ex in exs]
                state, m, _ = orl_iteration(state, step, cfg, prompts, verifier(tok, exs, G),
                                            jax.random.fold_in(key, rnd), sampler, ocfg, eos_token_ids=stops,
                                            pad_token_id=cfg.pad_token_id or 0, supervised_batch=rows)
            m = {k: float(v) for k, v in jax.device_get(m).items() if np.ndim(v) == 0}
            w.write(rnd + 1, m)
            stop = ck.should_stop(rnd + 1)
            if stop or (rnd + 1) % max(r.orl_rounds // 4, 1) == 0 or rnd + 1 == r.orl_rounds:
                ck.save(state, {"round": rnd + 1}, step=rnd + 1)
            if (rnd + 1) % max(r.orl_rounds // 10, 1) == 0:
                update = (f"loss {m['loss']:.4f}, replay entropy gap {m['replay_entropy_gap']:.1e}" if "loss" in m
                          else "no update (no verified response)")
                log(f"{name} round {rnd + 1}/{r.orl_rounds}: verified {m['verified']:.2f}, rollout TPF "
                    f"{m.get('rollout_tpf', float('nan')):.2f}, {update}; rollout {m['rollout_s']:.2f} s, "
                    f"replay {m['replay_s']:.2f} s, update {m['update_s']:.2f} s")
            if stop and rnd + 1 < r.orl_rounds:
                raise StageStopped(name, rnd + 1, r.orl_rounds)
    params = jax.device_get(state.params)
    checkpoint.save_params(out / name / "params", cfg, params, overwrite=True)  # a continued stage replaces it
    return params


def verifier(tok, exs, group: int):
    """verify(responses) for rollouts of `group` responses per example (row r answers exs[r // group]): all rows at
    once, so the code task's sandboxes run in parallel."""
    def verify(responses):
        texts = [decode_response(tok, np.asarray(t)) for t in responses]
        return tasks.verify_many([exs[r // group] for r in range(len(responses))], texts)

    return verify


def truth_states_round(r, tok, cfg, ocfg: ORLConfig, sampler):
    """(state, step, rnd, key, supervised rows) -> (state, metrics, arrays): one update of ORL's loss on states built
    from ground-truth answers (r.orl_source "truth_random" / "truth_forced" / "truth_forced_verified",
    train/truth_states.py; a diagnostic), for the round's P x G distinct train examples (one answer each, where a
    rollout round has G per prompt). "truth_forced_verified" first rolls out each example once under the current
    params (as ORL's rounds, G = 1) and keeps those whose rollout verifies: ORL's selection, ground-truth states."""
    n = r.orl_prompts * r.orl_group
    pad = cfg.pad_token_id or 0
    width = ocfg.max_prompt + ocfg.max_new_tokens + cfg.block_length + ocfg.max_states * cfg.block_length
    forced = r.orl_source.startswith("truth_forced")
    forced_step = make_forced_step(cfg, ocfg.residual, r.orl_threshold) if forced else None
    stops = stop_token_ids(tok)

    def one_round(state, step, rnd, key, sup_rows):
        t0 = time.perf_counter()
        exs = train_prompts(r, tok, ocfg.max_prompt, n, 100_000 + rnd)
        share = 1.0
        if r.orl_source == "truth_forced_verified":
            rows, out = rollout(state.params, cfg, [format_prompt(tok, ex.prompt) for ex in exs],
                                jax.random.fold_in(key, 3), sampler, dataclasses.replace(ocfg, group_size=1),
                                eos_token_ids=stops, pad_token_id=pad, mesh=getattr(step, "mesh", None))
            toks, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
            ok = verifier(tok, exs, 1)([toks[i, :lengths[i]] for i in range(n)])
            share, exs = float(np.mean(ok)), [ex for ex, good in zip(exs, ok) if good]
            if not exs:
                return state, {"verified": 0.0, "rollout_s": time.perf_counter() - t0, "replay_s": 0.0,
                               "replayed_states": 0, "update_s": 0.0}, None
        pairs = [format_example(tok, ex) for ex in exs]
        pairs = [(p, a[:ocfg.max_new_tokens]) for p, a in pairs]  # as a rollout's length cap cuts an answer
        prompts, answers = [p for p, _ in pairs], [a for _, a in pairs]
        if forced_step is None:
            cap = random_mask_capture(answers, cfg, jax.random.fold_in(key, 2), pad_id=pad)
        else:
            cap = forced_capture(state.params, cfg, prompts, answers, forced_step, rows=n, width=width,
                                 states=n * ocfg.max_states, pad_id=pad)
        batch = build_replay(prompts, cap, [True] * len(prompts), block_length=cfg.block_length, pad_id=pad,
                             prefix_attention=cfg.prefix_attention, mask_token_id=cfg.mask_token_id,
                             max_states=ocfg.max_states, rng=selection_rng(key, ocfg))
        blocks = -(-cap.lengths // cfg.block_length)  # forced decoding's tokens per forward (commits counted)
        per_row = cap.capture["active"][:cap.total_forwards].sum(0)
        metrics = {"verified": share, "rollout_s": time.perf_counter() - t0, "replay_s": 0.0}
        if forced_step is not None:
            metrics["rollout_tpf"] = float(np.mean(cap.lengths / (per_row + blocks - 1).clip(1)))
        return replay_update(state, step, batch, n, cfg.block_length, ocfg, metrics, sup_rows)

    return one_round


def run_rcd(r, args, out: Path, tok, cfg, params, log):
    obj = DiffusionObjective(block_length=r.block_length, remat=r.remat, ar_weight=r.ar_weight)
    loss_fn = diffusion_loss_fn(obj, cfg, with_reference=True)
    steps = rcd_steps(r)
    log(f"stage 2 baseline: RCD (off-policy residuals from the frozen converted model), {steps} updates")
    return _run_stage("stage2_rcd", out, cfg, lambda: params, loss_fn, stage2_optim(r, steps),
                      lambda: conversion_data(r, tok, args.seed + 3), steps, log, frozen=params,
                      deadline=args.deadline, continue_finished=True)


def stage2(r, args, out: Path, tok, cfg, params, log, methods=("orl", "noaec", "rcd")) -> dict:
    """{report name: (params, residual)} for the chosen of ORL ("orl"), ORL without AEC ("noaec"), the RCD
    baseline ("rcd") and "orl_rcd": ORL's on-policy rounds and losses applied to the RCD model in RCD's residual
    form (our variant: it trains the policy that already reads its residual, where ORL's adapter starts at zero).
    The residual is the one a mask-family model was trained with, hence decodes with: ORL's adapter on the
    previous step's soft token, RCD's interpolated embedding."""
    base = ORLLossConfig(l_aec=r.l_aec, pred_gate=r.pred_gate, l_anchor=r.l_anchor, ar_weight=r.ar_weight,
                         l_cert=r.l_cert, pred_norm=r.pred_norm)
    # our additions to ORL, not the method: named in the report
    ours = "".join(label for label, on in ((f" (l_cert {r.l_cert:g})", r.l_cert),
                                           (f" (+sup {r.orl_sup_weight:g})", r.orl_sup_weight),
                                           (f" (L_pred per {r.pred_norm})", r.pred_norm != "state"),
                                           (f" (states: {r.orl_source})", r.orl_source != "rollouts"),
                                           (" (group baseline)", r.orl_group_baseline),
                                           (" (replay without residual)", not r.orl_replay_residual)) if on)
    log(f"stage 2 ({', '.join(methods)}): ORL, {r.orl_rounds} rounds of {r.orl_prompts} prompts x "
        f"{r.orl_group} responses")
    rcd = functools.cache(lambda: run_rcd(r, args, out, tok, cfg, params, log))  # orl_rcd starts from it
    runs = {"orl": ("QwenDLM+ORL" + ours, ORLResidual(),
                    lambda: run_orl("stage2_orl", r, args, out, tok, cfg, params, base, log)),
            "noaec": ("QwenDLM+ORL (no AEC)" + ours, ORLResidual(),
                      lambda: run_orl("stage2_orl_noaec", r, args, out, tok, cfg, params,
                                      dataclasses.replace(base, l_aec=0.0), log)),
            "rcd": ("QwenDLM+RCD", RCDResidual(), rcd),
            "orl_rcd": ("QwenDLM+RCD+ORL" + ours, RCDResidual(),
                        lambda: run_orl("stage2_orl_rcd", r, args, out, tok, cfg, rcd(), base, log, RCDResidual()))}
    return {runs[m][0]: (runs[m][2](), runs[m][1]) for m in methods}
