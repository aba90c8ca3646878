"""List transformations: apply 1-3 operations in order to a list of small integers and give the final list.

Operations: sort ascending / descending, reverse, remove duplicates (keeping first occurrences), keep even / odd
numbers, keep numbers greater than k, add / subtract / multiply every element by k, keep the first k elements.
The worked solution shows every intermediate list (element-wise sums and products for the map steps), then
"#### [a, b, ...]". The verifier parses the final list and compares it element by element (any spacing).

Two registered sizes: `list_ops` (5-12 numbers up to 9, 20, 50 or 99, 1-3 operations) and `list_ops_short` (one
sort, reverse, dedupe, filter or prefix operation on 3-5 digits; no arithmetic), a task a CPU-sized model learns
within `make demo`'s minutes, so that its ORL rounds have verified rollouts to learn from. Both draw their split
in one space: an instance both can produce is held out in both or in neither.
"""

from __future__ import annotations

import random

from orl_jax.data.tasks.base import Example, Task, extract_final_answer, parse_int_list

FORMAT_INSTRUCTION = 'Work through the operations one at a time, then write the final list on the last line as ' \
                     '"#### [a, b, ...]".'


def _fmt(xs: list[int]) -> str:
    return "[" + ", ".join(str(x) for x in xs) + "]"


def _dedupe(xs):
    seen, out = set(), []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


# name -> (instruction, apply(xs, k), needs k, shows element-wise work with operator)
OPS = {
    "sort_asc": ("sort the list in ascending order", lambda xs, k: sorted(xs), None),
    "sort_desc": ("sort the list in descending order", lambda xs, k: sorted(xs, reverse=True), None),
    "reverse": ("reverse the list", lambda xs, k: xs[::-1], None),
    "dedupe": ("remove duplicates, keeping the first occurrence of each number", lambda xs, k: _dedupe(xs), None),
    "even": ("keep only the even numbers", lambda xs, k: [x for x in xs if x % 2 == 0], None),
    "odd": ("keep only the odd numbers", lambda xs, k: [x for x in xs if x % 2 == 1], None),
    "gt": ("keep only the numbers greater than {k}", lambda xs, k: [x for x in xs if x > k], None),
    "add": ("add {k} to every element", lambda xs, k: [x + k for x in xs], "+"),
    "sub": ("subtract {k} from every element", lambda xs, k: [x - k for x in xs], "-"),
    "mul": ("multiply every element by {k}", lambda xs, k: [x * k for x in xs], "*"),
    "first": ("keep only the first {k} elements", lambda xs, k: xs[:k], None),
}
INTROS = ("Start with the list {xs}.", "You are given the list {xs}.", "Take the list of integers {xs}.")


class ListOpsTask(Task):
    """lengths: (min, max) numbers in the list; highs: the largest value, one drawn per instance; op_weights: the
    relative frequency of 1, 2, ... operations; ops: the operations drawn from (names in OPS)."""

    split_space = "list_ops"  # an instance both sizes can draw is held out in both or in neither

    def __init__(self, name: str = "list_ops", lengths: tuple[int, int] = (5, 12),
                 highs: tuple[int, ...] = (9, 20, 50, 99), op_weights: tuple[int, ...] = (1, 3, 3),
                 ops: tuple[str, ...] = tuple(OPS)):
        self.ops = sorted(set(ops))
        if not self.ops or not set(self.ops) <= set(OPS):
            raise ValueError(f"ops must name operations of {sorted(OPS)}, got {ops!r}")
        if not 1 <= lengths[0] <= lengths[1]:
            raise ValueError(f"lengths must be (min, max) with 1 <= min <= max, got {lengths!r}")
        if not highs or min(highs) < 1:
            raise ValueError(f"highs must be largest values >= 1, got {highs!r}")
        if not 1 <= len(op_weights) <= len(self.ops) or min(op_weights) < 0 or not sum(op_weights) > 0:
            raise ValueError(f"op_weights must weigh 1..{len(self.ops)} operations (non-negative, not all 0), got "
                             f"{op_weights!r}")
        self.name, self.lengths, self.highs, self.op_weights = name, lengths, list(highs), list(op_weights)

    def _draw(self, rng: random.Random):
        while True:
            n = rng.randint(*self.lengths)
            hi = rng.choice(self.highs)
            xs = [rng.randint(0, hi) for _ in range(n)]
            if rng.random() < 0.4:  # make duplicates likely enough that dedupe has work to do
                xs[rng.randrange(n)] = xs[rng.randrange(n)]
            n_ops = rng.choices(range(1, len(self.op_weights) + 1), weights=self.op_weights)[0]
            names = rng.sample(self.ops, n_ops)
            ops, cur, lines = [], xs, [f"Start: {_fmt(xs)}"]
            for step, name in enumerate(names, 1):
                text, fn, sym = OPS[name]
                k = None
                if name == "gt":
                    k = rng.choice(sorted(cur)) if cur else 0
                elif name in ("add", "sub"):
                    k = rng.randint(1, 20)
                elif name == "mul":
                    k = rng.randint(2, 5)
                elif name == "first":
                    k = rng.randint(1, max(1, len(cur) - 1))
                new = fn(cur, k)
                label = text.format(k=k)
                if sym is not None:
                    work = ", ".join(f"{x} {sym} {k} = {y}" for x, y in zip(cur, new))
                    lines.append(f"Step {step}, {label}: {work}, giving {_fmt(new)}")
                elif name in ("even", "odd", "gt"):
                    dropped = [x for x in cur if x not in new]
                    why = f" (drop {', '.join(map(str, dropped))})" if dropped else " (nothing to drop)"
                    lines.append(f"Step {step}, {label}{why}: {_fmt(new)}")
                else:
                    lines.append(f"Step {step}, {label}: {_fmt(new)}")
                ops.append((name, k))
                cur = new
            if cur:
                break
        intro = rng.choice(INTROS).format(xs=_fmt(xs))
        steps = "\n".join(f"{i}. {OPS[name][0].format(k=k)}" for i, (name, k) in enumerate(ops, 1))
        question = f"{intro} Apply these operations in order:\n{steps}\nWhat is the resulting list?"
        return f"{xs}:{ops}", (question, lines, cur)

    def _build(self, draft) -> Example:
        question, lines, result = draft
        answer = _fmt(result)
        return Example(prompt=f"{question}\n{FORMAT_INSTRUCTION}", solution="\n".join(lines) + f"\n#### {answer}",
                       answer=answer, task=self.name)

    def verify(self, example: Example, response: str) -> bool:
        got = parse_int_list(extract_final_answer(response))
        return got is not None and got == parse_int_list(example.answer)
