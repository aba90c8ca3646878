"""Shared pieces of the embedded tasks: the Example record, the train / held-out partition, final-answer parsing.

Splits. Every task draws an instance from a seeded RNG and then assigns it to a split by a stable hash of its
*split key* (the prompt, or a coarser description of the instance such as the numbers and structure of a word
problem). `generate(index, split)` redraws (attempt 0, 1, ...) until the instance's hash falls in the requested
split, so the two splits are disjoint by construction: an instance (and so a prompt) that belongs to one split can
never be produced by the other, whatever the index. Same (task, index, split) -> same example, on any machine
(seeding uses random.Random(str), which hashes with SHA-512, not Python's salted hash()).

Final answers. Reference solutions end with a line "#### <answer>" (GSM8K's convention). A response's final
answer is the text after its last "####" (on that line, or the next non-empty one), or else the last
\\boxed{...}; each task then compares it to the reference by value (numbers, lists) or exactly modulo whitespace.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import random
import re
from collections.abc import Iterable, Sequence
from typing import Any

SPLITS = ("train", "heldout")
# Fraction of the instance space reserved for held-out evaluation (by hash of the split key).
HELDOUT_FRACTION = 0.2
MAX_ATTEMPTS = 10_000
MAX_ANSWER_CHARS = 4000  # a final answer longer than this is rejected without parsing


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str  # the user message (question + the instruction on how to format the final answer)
    solution: str  # the full reference response: worked steps, then a final "#### <answer>" line
    answer: str  # the reference final answer, as it appears after "####"
    task: str
    split: str = "train"
    index: int = -1
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # task-specific (e.g. hidden test cases)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


def check_index(index: int) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index must be a non-negative int, got {index!r}")
    return index


def split_of(key: str) -> str:
    """The split an instance belongs to, from a stable hash of its split key."""
    h = int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8, person=b"orl_jax-split").digest(), "big")
    return "heldout" if h % 1_000_000 < HELDOUT_FRACTION * 1_000_000 else "train"


class Task:
    """A procedural task: `generate(index, split) -> Example` and an exact `verify(example, response) -> bool`.

    Subclasses implement `_draw(rng) -> (split_key, draft)` (cheap, called once per attempt), `_build(draft) ->
    Example` (may be expensive; only for the accepted draw) and `verify`. `_build_many` may batch the expensive
    part (the program task runs all its programs in one sandboxed process)."""

    name: str = ""
    split_space: str = ""  # tasks that can draw the same instance share one (default: the name), hence its split

    def split_of_instance(self, key: str) -> str:
        """The split of the instance with this split key."""
        return split_of(f"{self.split_space or self.name}/{key}")

    def generate(self, index: int, split: str) -> Example:
        return self.generate_many([index], split)[0]

    def generate_many(self, indices: Iterable[int], split: str) -> list[Example]:
        check_split(split)
        drafts = [self._accepted_draft(check_index(i), split) for i in indices]
        examples = self._build_many([d for d, _ in drafts])
        return [dataclasses.replace(ex, task=self.name, split=split, index=i)
                for ex, (_, i) in zip(examples, drafts)]

    def _accepted_draft(self, index: int, split: str):
        for attempt in range(MAX_ATTEMPTS):
            key, draft = self._draw(random.Random(f"{self.name}/{split}/{index}/{attempt}"))
            if self.split_of_instance(key) == split:
                return draft, index
        raise RuntimeError(f"{self.name}: no {split} instance in {MAX_ATTEMPTS} draws (index {index})")

    def _draw(self, rng: random.Random) -> tuple[str, Any]:
        raise NotImplementedError

    def _build(self, draft: Any) -> Example:
        raise NotImplementedError

    def _build_many(self, drafts: Sequence[Any]) -> list[Example]:
        return [self._build(d) for d in drafts]

    def verify(self, example: Example, response: str) -> bool:
        raise NotImplementedError

    def verify_many(self, examples: Sequence[Example], responses: Sequence[str]) -> list[bool]:
        if len(examples) != len(responses):
            raise ValueError(f"{len(examples)} examples but {len(responses)} responses")
        return [self.verify(e, r) for e, r in zip(examples, responses)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# --- final-answer parsing -----------------------------------------------------------------------------------------

_FINAL = re.compile(r"####[ \t]*(?:\r?\n\s*)?([^\r\n]*)")
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def extract_final_answer(response: str) -> str | None:
    """The text after the last "####" marker (stripped), else the content of the last \\boxed{...}, else None."""
    if not isinstance(response, str):
        return None
    finals = _FINAL.findall(response)
    if finals:
        answer = finals[-1].strip()
    else:
        boxed = _BOXED.findall(response)
        if not boxed:
            return None
        answer = boxed[-1].strip()
    if not answer or len(answer) > MAX_ANSWER_CHARS:
        return None
    return answer


_INT = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)")


def parse_int(text: str | None) -> int | None:
    """An integer answer: optional sign, digits (thousands separators allowed), an optional leading "$" and
    trailing "."; anything else (decimals, words, several numbers) is None."""
    if text is None:
        return None
    t = text.strip()
    if t.startswith("$"):
        t = t[1:].strip()
    if t.endswith("."):
        t = t[:-1].rstrip()
    if not _INT.fullmatch(t):
        return None
    return int(t.replace(",", ""))


_INT_LIST = re.compile(r"\[\s*(?:[+-]?\d+\s*(?:,\s*[+-]?\d+\s*)*)?,?\s*\]")


def parse_int_list(text: str | None) -> list[int] | None:
    """A list of integers written as a Python list ("[1, 2, 3]", any whitespace); anything else is None."""
    if text is None:
        return None
    t = text.strip()
    if t.endswith("."):
        t = t[:-1].rstrip()
    if not _INT_LIST.fullmatch(t):
        return None
    return [int(x) for x in re.findall(r"[+-]?\d+", t)]


def _literal(text: str):
    """ast.literal_eval, but numbers must be spelled the way Python prints them ("0", "12", "-3", "1.5"), so "00",
    "0x10", "1_000", "+3" or "12.0" for 12 are not read as numbers."""
    tree = ast.parse(text, mode="eval")
    for node in ast.walk(tree):
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd):
            raise ValueError("unary +")
        if isinstance(node, ast.Constant) and type(node.value) in (int, float, complex):
            if ast.get_source_segment(text, node) != repr(node.value):
                raise ValueError("non-canonical number")
    return ast.literal_eval(tree)


def canonical_output(text: str) -> str:
    """Canonical form of a printed value: repr() of the Python literal it spells (so "[1,2]" == "[1, 2]" and
    "{'a':1}" == "{'a': 1}", while "1" != "True" != "1.0" and "00" != "0"), or else the text with runs of whitespace
    collapsed."""
    t = text.strip()
    if len(t) <= MAX_ANSWER_CHARS:
        try:
            return "lit:" + repr(_literal(t))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    return "txt:" + " ".join(t.split())
