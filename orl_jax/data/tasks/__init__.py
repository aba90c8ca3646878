"""Embedded, verifiable tasks: procedural generators with disjoint train / held-out splits and exact verifiers.

    from orl_jax.data.tasks import TASKS, sample, verify
    ex = TASKS["arithmetic"].generate(0, "train")     # Example(prompt, solution, answer, task, split, index, meta)
    TASKS["arithmetic"].verify(ex, model_response)    # True iff the response's final answer is right
    batch = sample("train", 64, seed=0)               # a mixed, reproducible batch over all tasks

Tasks: arithmetic (GSM8K-like word problems), list_ops (list transformations; list_ops_short: one operation on a
few digits, the CPU demo's task), program_output (predict what a
generated Python program prints; reference from a sandboxed run) and code_function (write a function, checked
by running it in the sandbox on hidden inputs). See base.py for the split construction and answer parsing, and
sandbox.py for what the sandbox does and does not guarantee.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence

from orl_jax.data.tasks.arithmetic import ArithmeticTask
from orl_jax.data.tasks.base import SPLITS, Example, Task, check_split, extract_final_answer
from orl_jax.data.tasks.code import CodeFunctionTask
from orl_jax.data.tasks.lists import ListOpsTask
from orl_jax.data.tasks.program import ProgramOutputTask

TASKS: dict[str, Task] = {t.name: t for t in (
    ArithmeticTask(), ListOpsTask(), ProgramOutputTask(), CodeFunctionTask(),
    ListOpsTask("list_ops_short", lengths=(3, 5), highs=(9,), op_weights=(1,),
                ops=("sort_asc", "sort_desc", "reverse", "dedupe", "even", "odd", "gt", "first")))}

__all__ = ["SPLITS", "TASKS", "Example", "Task", "extract_final_answer", "sample", "task_names", "verify",
           "verify_many"]


def task_names(tasks: Sequence[str] | None) -> list[str]:
    """The named tasks (None: all), checked: ValueError for none or an unknown one."""
    names = list(TASKS) if tasks is None else list(tasks)
    if not names:
        raise ValueError("tasks must name at least one task")
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; known: {sorted(TASKS)}")
    return names


def sample(split: str, n: int, seed: int, tasks: Sequence[str] | None = None) -> list[Example]:
    """n examples of `split`, each from a task chosen uniformly from `tasks` (default: all) with a random index;
    the same (split, n, seed, tasks) gives the same list. Expensive parts are batched per task."""
    check_split(split)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    names = task_names(tasks)
    rng = random.Random(f"orl_jax.tasks.sample/{split}/{seed}/{','.join(names)}")
    picks = [(rng.choice(names), rng.randrange(2**40)) for _ in range(n)]
    by_task: dict[str, list[int]] = defaultdict(list)
    for pos, (name, _) in enumerate(picks):
        by_task[name].append(pos)
    out: list[Example | None] = [None] * n
    for name, positions in by_task.items():
        for pos, ex in zip(positions, TASKS[name].generate_many([picks[p][1] for p in positions], split)):
            out[pos] = ex
    return out  # type: ignore[return-value]


def verify(example: Example, response: str) -> bool:
    return TASKS[example.task].verify(example, response)


def verify_many(examples: Sequence[Example], responses: Sequence[str]) -> list[bool]:
    """verify over a batch, grouped per task (the code task runs its sandboxes in parallel)."""
    if len(examples) != len(responses):
        raise ValueError(f"{len(examples)} examples but {len(responses)} responses")
    out = [False] * len(examples)
    by_task: dict[str, list[int]] = defaultdict(list)
    for i, ex in enumerate(examples):
        by_task[ex.task].append(i)
    for name, idx in by_task.items():
        for i, ok in zip(idx, TASKS[name].verify_many([examples[i] for i in idx], [responses[i] for i in idx])):
            out[i] = ok
    return out
