"""recipes/train_qwendlm.py end to end on its `smoke` preset: tokenizer, stages 0-2, evaluation, report,
and `--resume` reusing finished stages."""

import json
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

import train_qwendlm  # noqa: E402


def test_recipe_smoke_end_to_end_and_resume(tmp_path):
    out = tmp_path / "run"
    train_qwendlm.main(["--preset", "smoke", "--out", str(out)])
    for f in ("report.md", "results.jsonl", "accuracy_vs_tpf.png", "stage0/params/config.json",
              "stage1/params/config.json", "stage0/logs/metrics.jsonl", "tokenizer/tokenizer.json",
              "stage2_orl/params/config.json", "stage2_orl/logs/metrics.jsonl", "stage2_orl_noaec/params/config.json",
              "stage2_rcd/params/config.json"):
        assert (out / f).exists(), f
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["AR (greedy)", "QwenDLM weights, AR decoding", "QwenDLM", "QwenDLM+ORL",
                                           "QwenDLM+ORL (no AEC)", "QwenDLM+RCD"]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["tpf"] > 0 for r in rows)
    assert all(list(r["per_task"]) == ["arithmetic"] and r["per_task"]["arithmetic"] == r["accuracy"] for r in rows)
    report = (out / "report.md").read_text()
    assert "| arithmetic |" in report and "paired 95% interval" in report
    assert all(len(r["hits"]) == r["n"] and np.mean(r["hits"]) == pytest.approx(r["accuracy"]) for r in rows)
    assert all(r["setting"] == "steps<=4, confidence=0.3, entropy bound=0.05" for r in rows[2:])
    assert rows[1]["tpf"] == 1.0
    steps = [json.loads(line)["step"] for line in (out / "stage0/logs/metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6
    stage1 = [json.loads(line) for line in (out / "stage1/logs/metrics.jsonl").read_text().splitlines()]
    assert all(m["tokens"] > 0 for m in stage1), "a conversion batch had no supervised response tokens"
    assert all(m["ar_loss"] > 0 for m in stage1), "the preset's next-token term (ar_weight) is not trained"
    rcd = [json.loads(line) for line in (out / "stage2_rcd/logs/metrics.jsonl").read_text().splitlines()]
    assert all(m["ar_loss"] > 0 for m in rcd), "RCD dropped the conversion's next-token term"
    orl = [json.loads(line) for line in (out / "stage2_orl/logs/metrics.jsonl").read_text().splitlines()]
    assert len(orl) == 2 and all(0.0 <= m["verified"] <= 1.0 and m["rollout_tpf"] > 0 for m in orl)
    with pytest.raises(SystemExit, match="--resume"):
        train_qwendlm.main(["--preset", "smoke", "--out", str(out)])
    before = (out / "stage1/params/config.json").stat().st_mtime
    train_qwendlm.main(["--preset", "smoke", "--out", str(out), "--resume"])  # stages reused, eval re-run
    assert (out / "stage1/params/config.json").stat().st_mtime == before
    assert json.loads((out / "stage1/params/config.json").read_text())["orl_jax"]["logit_shift"] is True
    with pytest.raises(ValueError, match="logit_shift=True"):  # a changed flag never reuses the other model
        train_qwendlm.main(["--preset", "smoke", "--out", str(out), "--resume", "--no-logit-shift"])


def test_stage2_methods_split_over_processes_then_one_evaluation(tmp_path, monkeypatch):
    """Stage-2 methods trained by separate runs sharing --out (as one process per GPU would), evaluated once."""
    out = tmp_path / "run"
    train_qwendlm.main(["--preset", "smoke", "--out", str(out), "--stage2-methods", "noaec,rcd", "--no-eval"])
    assert (out / "stage2_rcd/params/config.json").exists() and not (out / "stage2_orl").exists()
    assert not (out / "report.md").exists()
    train_qwendlm.main(["--preset", "smoke", "--out", str(out), "--resume", "--stage2-methods", "orl", "--no-eval"])
    assert (out / "stage2_orl/params/config.json").exists()
    # a larger --orl-rounds continues the finished ORL and RCD stages from their checkpoints, and replaces exports
    before = {n: (out / n / "params/config.json").stat().st_mtime_ns for n in ("stage2_orl", "stage2_rcd")}
    train_qwendlm.main(["--preset", "smoke", "--out", str(out), "--resume", "--stage2-methods", "orl,rcd",
                        "--orl-rounds", "3", "--no-eval"])
    for name in ("stage2_orl", "stage2_rcd"):
        steps = [json.loads(line)["step"] for line in (out / name / "logs/metrics.jsonl").read_text().splitlines()]
        assert steps[0] == 1 and steps[-1] == 3 and steps == sorted(set(steps)), (name, steps)
        assert (out / name / "params/config.json").stat().st_mtime_ns > before[name]
    # --rcd-steps gives RCD its own update count: it continues to 5 while ORL stays at its 3 rounds
    train_qwendlm.main(["--preset", "smoke", "--out", str(out), "--resume", "--stage2-methods", "rcd",
                        "--orl-rounds", "3", "--rcd-steps", "5", "--no-eval"])
    steps = [json.loads(line)["step"] for line in (out / "stage2_rcd/logs/metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 5
    from orl_jax.train import stages

    residuals, evaluate = {}, stages.evaluate

    def recording(*a, method, **kw):  # the residual each row decodes with
        residuals[method] = type(kw.get("residual")).__name__
        return evaluate(*a, method=method, **kw)

    monkeypatch.setattr(stages, "evaluate", recording)
    # reuses all three, evaluates each also without its residual
    train_qwendlm.main(["--preset", "smoke", "--out", str(out), "--resume", "--residual-ablation"])
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    trained = ["QwenDLM+ORL", "QwenDLM+ORL (no AEC)", "QwenDLM+RCD"]
    assert [r["method"] for r in rows] == ["AR (greedy)", "QwenDLM weights, AR decoding", "QwenDLM", *trained,
                                           *[m + ", residual off" for m in trained]]
    # the uniform family decodes with self-conditioning, the ablation rows without any residual
    assert {m: residuals[m] for m in trained} == dict.fromkeys(trained, "ORLResidual")
    assert {residuals[m + ", residual off"] for m in trained} == {"NoResidual"}
    with pytest.raises(SystemExit):
        train_qwendlm.main(["--preset", "smoke", "--out", str(tmp_path / "x"), "--stage2-methods", "orl,ppo"])
    for nothing_to_ablate in ("--skip-stage2", "--no-eval"):  # refused before any work, nothing left behind
        with pytest.raises(SystemExit):
            train_qwendlm.main(["--preset", "smoke", "--out", str(tmp_path / "y"), "--residual-ablation",
                                nothing_to_ablate])
        assert not (tmp_path / "y").exists()



def test_a_grown_stage_2_equals_one_run_of_all_its_updates(tmp_path):
    """RCD trained 2 updates, then grown to 3 by a --resume with a larger --orl-rounds, ends with exactly the params
    of one run of 3 (the checkpoint restores the optimizer and the data iterator; the warmup is 1 update in both)."""
    import shutil

    from orl_jax.checkpoint import load_params

    args = ["--preset", "smoke", "--stage2-methods", "rcd", "--no-eval"]
    one, grown = tmp_path / "one", tmp_path / "grown"
    train_qwendlm.main(args + ["--out", str(one), "--orl-rounds", "3"])
    grown.mkdir()
    for part in ("tokenizer", "stage0", "stage1"):  # the same base: stages 0-1 are reused, not retrained
        shutil.copytree(one / part, grown / part)
    train_qwendlm.main(args + ["--out", str(grown), "--orl-rounds", "2", "--resume"])
    train_qwendlm.main(args + ["--out", str(grown), "--orl-rounds", "3", "--resume"])
    _, want = load_params(one / "stage2_rcd/params")
    _, got = load_params(grown / "stage2_rcd/params")
    _, base = load_params(one / "stage1/params")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))  # the updates did move the weights
               for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(base)))

def test_mask_family_runs_every_stage_2_method(tmp_path):
    """--noise mask: conversion with [MASK] noise, ORL with mask-family rollouts (g_phi weighted at [MASK]), RCD in
    its own residual form, and an evaluation that decodes each with the residual it was trained with. (The smoke
    model verifies no response, so its ORL rounds take no update: tests/test_orl.py covers the mask-family update.)"""
    out = tmp_path / "run"
    train_qwendlm.main(["--preset", "smoke", "--out", str(out), "--noise", "mask", "--stage2-methods",
                        "orl,rcd,orl_rcd"])
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["AR (greedy)", "QwenDLM weights, AR decoding", "QwenDLM", "QwenDLM+ORL",
                                           "QwenDLM+RCD", "QwenDLM+RCD+ORL"]
    assert all(r["tpf"] > 0 and "fill threshold" in r["setting"] for r in rows[2:])
    for name in ("stage2_orl", "stage2_orl_rcd"):  # orl_rcd: ORL rounds on the RCD model (trained once, reused)
        orl = [json.loads(line) for line in (out / name / "logs/metrics.jsonl").read_text().splitlines()]
        assert len(orl) == 2 and all(m["rollout_tpf"] > 0 for m in orl)  # (tests/test_orl.py checks the update)
    # no response verifies, so no update: orl_rcd exports the params it started from, RCD's (not the base's)
    from orl_jax.checkpoint import load_params

    leaves = lambda name: jax.tree.leaves(load_params(out / name / "params")[1])  # noqa: E731
    assert all(np.array_equal(a, b) for a, b in zip(leaves("stage2_rcd"), leaves("stage2_orl_rcd")))
    assert not all(np.array_equal(a, b) for a, b in zip(leaves("stage1"), leaves("stage2_orl_rcd")))
    assert "RCDResidual" in (out / "report.md").read_text()


def test_base_package_exports_the_conversion_and_starts_stage_2_elsewhere(tmp_path):
    """--export-package writes stage 1's QwenDLM (bfloat16 shards <= 15 MiB, the tokenizer); --base-package starts a
    new run from it (no stages 0-1, no AR row), which later --resume runs keep; wrong packages fail before any work."""
    from orl_jax.checkpoint import load_params

    first, pkg = tmp_path / "first", tmp_path / "pkg"
    base = ["--preset", "smoke", "--noise", "mask"]
    train_qwendlm.main(base + ["--out", str(first), "--skip-stage2", "--no-eval", "--export-package", str(pkg)])
    shards = list(pkg.glob("*.safetensors"))
    assert shards and all(f.stat().st_size <= 15 * 2**20 for f in shards) and (pkg / "tokenizer.json").exists()
    with pytest.raises(SystemExit):  # the package goes to a new directory only
        train_qwendlm.main(base + ["--out", str(tmp_path / "again"), "--export-package", str(pkg)])

    second = tmp_path / "second"
    train_qwendlm.main(base + ["--out", str(second), "--base-package", str(pkg), "--stage2-methods", "orl",
                               "--no-eval"])
    assert not (second / "stage0").exists() and (second / "stage2_orl/params").exists()
    want = load_params(first / "stage1/params")[1]
    got = load_params(second / "stage1/params")[1]
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):  # the weights, rounded to bfloat16 once
        assert b.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32), np.asarray(b))
    train_qwendlm.main(base + ["--out", str(second), "--resume", "--stage2-methods", "orl"])  # no flag needed
    rows = [json.loads(line) for line in (second / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows][:2] == ["QwenDLM weights, AR decoding", "QwenDLM"]
    assert "from the base package" in (second / "report.md").read_text()

    for bad in (["--base-package", str(tmp_path / "nope")], ["--base-package", str(first)],
                ["--base-package", str(pkg), "--hf-model", str(pkg)]):
        with pytest.raises(SystemExit):
            train_qwendlm.main(base + ["--out", str(tmp_path / "bad")] + bad)
        assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match="noise"):  # another model than this run asks for (uniform noise)
        train_qwendlm.main(["--preset", "smoke", "--out", str(tmp_path / "other"), "--base-package", str(pkg)])
    assert not (tmp_path / "other").exists()  # nothing of the refused run is left behind


def test_stopped_stage_exits_before_later_stages_then_resume_finishes(tmp_path, monkeypatch):
    """SIGTERM during a stage (here: CheckpointManager.should_stop) saves, exports nothing, runs no later stage or
    evaluation, exits with EXIT_STOPPED; --resume continues. Stage 2 (ORL rounds) stops the same way."""
    from orl_jax.train.ckpt import CheckpointManager

    out = tmp_path / "run"
    args = ["--preset", "smoke", "--out", str(out), "--stage2-methods", "orl", "--no-eval"]
    monkeypatch.setattr(CheckpointManager, "should_stop", lambda self, step: step >= 3)
    with pytest.raises(SystemExit) as e:
        train_qwendlm.main(args)
    assert e.value.code == train_qwendlm.EXIT_STOPPED
    assert (out / "stage0/ckpt").exists() and not (out / "stage0/params").exists() and not (out / "stage1").exists()
    monkeypatch.setattr(CheckpointManager, "should_stop", lambda self, step: "stage2" in self.directory.parent.name)
    with pytest.raises(SystemExit) as e:
        train_qwendlm.main(args + ["--resume"])
    assert e.value.code == train_qwendlm.EXIT_STOPPED
    steps = [json.loads(line)["step"] for line in (out / "stage0/logs/metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6 and (out / "stage1/params/config.json").exists()
    assert len((out / "stage2_orl/logs/metrics.jsonl").read_text().splitlines()) == 1
    assert not (out / "stage2_orl/params").exists()
    # a lower --orl-rounds ends the stopped stage at its checkpoint (to evaluate it now); a later run grows it again
    train_qwendlm.main(args + ["--resume", "--orl-rounds", "1"])
    assert (out / "stage2_orl/params/config.json").exists()
    assert len((out / "stage2_orl/logs/metrics.jsonl").read_text().splitlines()) == 1
    ended = (out / "stage2_orl/params/config.json").stat().st_mtime_ns
    monkeypatch.undo()
    train_qwendlm.main(args + ["--resume"])
    assert len((out / "stage2_orl/logs/metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "stage2_orl/params/config.json").stat().st_mtime_ns > ended  # the grown stage exported again
    with pytest.raises(SystemExit, match="needs an NVIDIA GPU"):  # the h200 preset trains with cuDNN attention
        train_qwendlm.main(["--preset", "h200", "--out", str(tmp_path / "cpu")])
    assert not (tmp_path / "cpu").exists()
    for bad in (["--orl-rounds", "0"], ["--lr2", "-1e-5"], ["--attention-impl", "flash"], ["--l-aec", "-1"],
                ["--l-aec", "nan"], ["--time-limit", "0"], ["--ar-weight", "-1"], ["--adapter-lr-scale", "nan"],
                ["--orl-prompts", "0"], ["--time-limit", "5", "--distributed"], ["--orl-prompt-pool", "-1"],
                ["--orl-threshold", "0"], ["--orl-threshold", "1.5"], ["--orl-temperature", "0"],
                ["--orl-group", "0"], ["--pred-gate", "-0.1"], ["--l-anchor", "-1"], ["--l-anchor", "nan"]):
        with pytest.raises(SystemExit):
            train_qwendlm.main(args + bad)
    # a time limit stops the running stage the same way (checkpoint, exit 75), for a job scheduler's wall clock
    with pytest.raises(SystemExit) as e:
        train_qwendlm.main(["--preset", "smoke", "--out", str(tmp_path / "limited"), "--time-limit", "1e-9"])
    assert e.value.code == train_qwendlm.EXIT_STOPPED
    assert (tmp_path / "limited/stage0/ckpt").exists() and not (tmp_path / "limited/stage0/params").exists()


def test_conversion_responses_fill_their_last_block_with_end_of_turn(tmp_path):
    from orl_jax.data.embedded_tokenizer import task_corpus, train_tokenizer
    from orl_jax.data.prompt_format import end_of_turn_id
    from orl_jax.data.tokenizer import load_tokenizer
    from orl_jax.train import stages

    r = train_qwendlm.PRESETS["smoke"]
    train_tokenizer(task_corpus(n_per_task=40, tasks=list(r.tasks)), r.vocab_size, tmp_path)
    tok = load_tokenizer(tmp_path)
    examples = stages._examples(r, "train", 16, 0)
    plain, filled = stages._encode(tok, examples, 10_000), stages._encode(tok, examples, 10_000, r.block_length)
    eot = end_of_turn_id(tok)
    assert any(len(a["tokens"]) < len(b["tokens"]) for a, b in zip(plain, filled))
    for a, b in zip(plain, filled):
        n, plen = len(a["tokens"]), int(a["prompt_mask"].sum())
        assert (len(b["tokens"]) - plen) % r.block_length == 0 and int(b["prompt_mask"].sum()) == plen
        assert (b["tokens"][:n] == a["tokens"]).all() and (b["tokens"][n - 1:] == eot).all()


def test_orl_rounds_draw_fresh_prompts_or_cycle_a_fixed_pool(tmp_path):
    import dataclasses

    from orl_jax.data.embedded_tokenizer import task_corpus, train_tokenizer
    from orl_jax.data.tokenizer import load_tokenizer
    from orl_jax.train.stage2 import round_examples

    r = dataclasses.replace(train_qwendlm.PRESETS["smoke"], orl_prompts=2)
    train_tokenizer(task_corpus(n_per_task=40, tasks=list(r.tasks)), r.vocab_size, tmp_path)
    tok = load_tokenizer(tmp_path)
    prompts = lambda r, rnd: [ex.prompt for ex in round_examples(r, tok, 320)(rnd)]  # noqa: E731
    assert prompts(r, 0) != prompts(r, 1) and prompts(r, 1) == prompts(r, 1)  # fresh, reproducible (--resume)
    pooled = dataclasses.replace(r, orl_prompt_pool=3)
    p0, p1, p3 = prompts(pooled, 0), prompts(pooled, 1), prompts(pooled, 3)
    assert len(set(p0 + p1)) == 3 and p1[1] == p0[0] and p3 == p0  # prompts 0 1 | 2 0 | 1 2 | 0 1


def test_stage_2_on_ground_truth_states_takes_an_update_every_round(tmp_path, monkeypatch):
    """--orl-source truth_random / truth_forced (diagnostics, train/truth_states.py): ORL's replay, loss and update on
    states built from ground-truth answers; every round updates (nothing to verify), unlike the smoke model's
    rollouts, and the report names the variant."""
    from orl_jax.checkpoint import load_params

    pkg, base = tmp_path / "pkg", ["--preset", "smoke", "--noise", "mask"]
    train_qwendlm.main(base + ["--out", str(tmp_path / "first"), "--skip-stage2", "--no-eval",
                               "--export-package", str(pkg)])
    for source, extra in (("truth_random", ["--pred-norm", "block", "--no-eval"]), ("truth_forced", []),
                          ("truth_forced_verified", ["--no-eval"])):
        out = tmp_path / source
        train_qwendlm.main(base + ["--out", str(out), "--base-package", str(pkg), "--stage2-methods", "orl",
                                   "--orl-source", source] + extra)
        logs = [json.loads(line) for line in (out / "stage2_orl/logs/metrics.jsonl").read_text().splitlines()]
        if source == "truth_forced_verified":  # the smoke model's rollouts verify nothing: no update, params kept
            assert len(logs) == 2 and all(m["verified"] == 0.0 and m["replayed_states"] == 0 for m in logs)
            from orl_jax.data import tasks

            # a verifier that accepts every other rollout: those examples' ground-truth states are trained
            monkeypatch.setattr(tasks, "verify_many", lambda exs, texts: [i % 2 == 0 for i in range(len(texts))])
            out = tmp_path / "verified_half"
            train_qwendlm.main(base + ["--out", str(out), "--base-package", str(pkg), "--stage2-methods", "orl",
                                       "--orl-source", source, "--no-eval"])
            logs = [json.loads(line) for line in (out / "stage2_orl/logs/metrics.jsonl").read_text().splitlines()]
            assert all(m["verified"] == 0.5 and m["replayed_states"] > 0 and "loss" in m for m in logs)
            continue
        assert len(logs) == 2 and all(m["verified"] == 1.0 and m["replayed_states"] > 0 and np.isfinite(m["loss"])
                                      for m in logs)
        assert all(("rollout_tpf" in m) == (source == "truth_forced") for m in logs)
        start = jax.tree.leaves(load_params(out / "stage1/params")[1])  # the imported base
        trained = jax.tree.leaves(load_params(out / "stage2_orl/params")[1])
        assert not all(np.array_equal(a, b) for a, b in zip(start, trained))
    assert "QwenDLM+ORL (states: truth_forced)" in (tmp_path / "truth_forced/report.md").read_text()


def test_held_out_examples_follow_eval_seed_not_seed(monkeypatch):
    """--seed changes training only: runs of different seeds are evaluated on the same held-out examples."""
    from types import SimpleNamespace

    from orl_jax.train import stages

    class Drawn(Exception):
        pass

    def heldout(r, tok, seed):
        raise Drawn(seed)

    monkeypatch.setattr(stages, "heldout_examples", heldout)
    args = train_qwendlm.parse_args(["--seed", "5"])
    assert (args.seed, args.eval_seed) == (5, 0)
    for eval_seed in (0, 3):
        with pytest.raises(Drawn) as got:
            stages.evaluate_all(None, SimpleNamespace(seed=5, eval_seed=eval_seed), None, None, None, None, None, {},
                                print, 0.0)
        assert got.value.args == (eval_seed + 7,)


def test_held_out_that_cannot_fit_fails_before_training_and_leaves_nothing(tmp_path, monkeypatch):
    """A preset whose held-out examples do not fit its budgets stops as soon as the tokenizer exists (not after
    the stages have trained), and removes the --out folder it created."""
    import dataclasses

    from orl_jax.train import stages

    strict = dataclasses.replace(train_qwendlm.PRESETS["smoke"], eval_fit=True)  # 16 new tokens: nothing fits
    monkeypatch.setitem(train_qwendlm.PRESETS, "smoke", strict)
    trained = []
    monkeypatch.setattr(stages, "_run_stage", lambda *a, **k: trained.append(a[0]))
    out = tmp_path / "run"
    with pytest.raises(stages.HeldoutDoesNotFit, match="held-out examples fit eval_max_new=16"):
        train_qwendlm.main(["--preset", "smoke", "--out", str(out)])
    assert trained == [] and not out.exists()


def test_tasks_and_noise_flags_resolve_against_the_preset(capsys):
    """--tasks picks the task suite (unknown names fail before anything runs, naming the flag); --noise defaults to
    the preset's family (the CPU demo's is the mask family, the h200 preset's the uniform one)."""
    args = train_qwendlm.parse_args([])
    assert (args.tasks, args.noise) == (None, train_qwendlm.PRESETS["default"].noise)
    assert train_qwendlm.parse_args(["--preset", "h200"]).noise == "uniform"
    assert train_qwendlm.parse_args(["--noise", "uniform"]).noise == "uniform"
    args = train_qwendlm.parse_args(["--tasks", "list_ops,arithmetic,list_ops"])
    assert args.tasks == ("list_ops", "arithmetic")
    for bad in ("list_ops,sorting", ",", ""):
        with pytest.raises(SystemExit):
            train_qwendlm.parse_args(["--tasks", bad])
        assert "--tasks" in capsys.readouterr().err
