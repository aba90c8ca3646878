"""benchmarks/run_gpu_jobs.sh (how device calls run jobs side by side): each job gets its GPUs and its own log, a job
past SECONDS is stopped with SIGTERM, and everything comes back in one results.tgz (the device returns <= 8 files)."""

import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_jobs_run_side_by_side_and_come_back_in_one_archive(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "outputs/run/stage0/logs").mkdir(parents=True)  # a recipe run's files, as on the device
    (tmp_path / "outputs/run/report.md").write_text("report")
    (tmp_path / "outputs/run/stage0/logs/metrics.jsonl").write_text("{}")
    jobs = ['0,1|echo "[00:00:00] gpus $CUDA_VISIBLE_DEVICES"; echo \'{"summary": 1}\' > $BENCH/x.jsonl',
            "2|trap 'echo stopped; exit 75' TERM; sleep 30 & wait"]
    res = subprocess.run(["bash", str(ROOT / "benchmarks/run_gpu_jobs.sh"), str(out), "3", *jobs], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert [p.name for p in out.iterdir()] == ["results.tgz"]
    with tarfile.open(out / "results.tgz") as tar:
        names = set(tar.getnames())
        logs = {n: tar.extractfile(n).read().decode() for n in ("logs/job0.log", "logs/job1.log")}
    assert {"logs/gpu.txt", "bench/x.jsonl", "outputs/run/report.md", "outputs/run/stage0/logs/metrics.jsonl"} <= names
    assert "[00:00:00] gpus 0,1" in logs["logs/job0.log"] and "== exit 0" in logs["logs/job0.log"]
    assert "stopped" in logs["logs/job1.log"] and "== exit 75" in logs["logs/job1.log"]  # SIGTERM reached the job
    assert "[00:00:00] gpus 0,1" in res.stdout and '{"summary": 1}' in res.stdout


def test_ab_runs_both_trees_alternately(tmp_path):
    """benchmarks/run_ab.sh: the command runs in the baseline tree and in this one, base/new/base/new, each with its
    own AB_OUT; a missing baseline is refused."""
    base, new, out = tmp_path / "base", tmp_path / "new", tmp_path / "out"
    for tree, name in ((base, "old"), (new, "new")):
        tree.mkdir()
        (tree / "version.txt").write_text(name + "\n")
    (base / "orl_jax_kernels").mkdir()  # a baseline of session 36: its kernels under their import name
    (base / "orl_jax_kernels" / "__init__.py").write_text("")
    (new / "kernels").mkdir()
    (new / "orl_jax_kernels" / "__pycache__").mkdir(parents=True)  # left behind by a checkout of session 36
    cmd = 'cat version.txt > $AB_OUT/v.txt; date +%s%N >> $AB_OUT/v.txt; echo $PYTHONPATH > $AB_OUT/path.txt'
    res = subprocess.run(["bash", str(ROOT / "benchmarks/run_ab.sh"), str(base), str(out), cmd], cwd=new,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    got = {d: (out / d / "v.txt").read_text().split() for d in ("base1", "new1", "base2", "new2")}
    assert [got[d][0] for d in ("base1", "new1", "base2", "new2")] == ["old", "new", "old", "new"]
    times = [int(got[d][1]) for d in ("base1", "new1", "base2", "new2")]
    assert times == sorted(times)  # alternating, in this order
    for d, tree in (("base1", base), ("new2", new)):  # each side imports its own tree's code first
        path = (out / d / "path.txt").read_text().strip().split(":")
        if tree is new:  # kernels/: a shim, ahead of the tree and its stale orl_jax_kernels/, gives it its import name
            assert (Path(path[0]) / "orl_jax_kernels").resolve() == (tree / "kernels").resolve()
            assert path[1] == str(tree.resolve())
        else:
            assert path[0] == str(tree.resolve())
            assert all("orl_jax_kernels" not in os.listdir(p) for p in path[1:] if p and os.path.isdir(p))
    one = tmp_path / "one"
    res = subprocess.run(["bash", str(ROOT / "benchmarks/run_ab.sh"), str(base), str(one), cmd], cwd=new,
                         capture_output=True, text=True, timeout=60, env=os.environ | {"ROUNDS": "1"})
    assert res.returncode == 0 and sorted(p.name for p in one.iterdir()) == ["base1", "new1"]
    res = subprocess.run(["bash", str(ROOT / "benchmarks/run_ab.sh"), str(tmp_path / "nope"), str(out), cmd],
                         cwd=new, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no baseline tree" in res.stderr
