"""Write a small Python function from a description and examples (HumanEval-like), checked by running it.

Sixteen parameterized function families (sums and counts over lists, running totals, k-th largest, letter counts,
Caesar shifts, palindromes, digit powers, fizz-buzz words, differences, chunk sums, word lengths, runs,
rotations, alternating sums). The prompt gives the signature, the description and three examples; the verifier
runs the candidate on those three plus five hidden inputs (edge cases included) in the sandbox and compares each
result with the reference value, type included (a tuple is not a list, True is not 1).

The response must contain the function in a fenced code block (the last ```python block, else the last ```
block, is used). The reference solution is one sentence of explanation and the reference implementation.

The comparison happens in the parent, not in the sandboxed process: the child only prints the repr of each result
(plain ints, strings, bools, None, lists, tuples, dicts; anything else counts as a failure), so code that tampers
with the harness inside the child still has to produce the hidden expected values to pass. Whatever the candidate
prints while its function runs is discarded.

Split key: the family and its parameters, so a held-out problem asks for a function that no training problem
asks for (the same family with other constants).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from orl_jax.data.tasks import sandbox
from orl_jax.data.tasks.base import MAX_ANSWER_CHARS, Example, Task

FORMAT_INSTRUCTION = "Reply with the complete function in a ```python code block. It will be checked on these " \
                     "examples and on other inputs."
N_SHOWN, N_HIDDEN = 3, 5
VERIFY_TIMEOUT_S = 5.0
LETTERS = "abcdefghijklmnopqrstuvwxyz"
WORDS = ("sun", "tree", "a", "river", "go", "mountain", "sky", "red", "blue", "elephant", "cat", "is", "window")
FIZZ = ("Fizz", "Buzz", "Bang", "Pop", "Zip", "Zap")
ORDINAL = {1: "largest", 2: "second largest", 3: "third largest"}


@dataclasses.dataclass(frozen=True)
class Family:
    fname: str
    args: str
    params: Callable[[random.Random], dict]
    describe: Callable[[dict], str]  # the sentence after "that"
    explain: Callable[[dict], str]  # one-sentence explanation in the reference solution
    body: Callable[[dict], str]  # the reference implementation's body (indented 4)
    fn: Callable[[dict], Callable]  # the same function in-process, for the expected values
    inputs: Callable[[random.Random, dict], list[tuple]]  # N_SHOWN + N_HIDDEN argument tuples


def _ints(rng, lo=0, hi=20, n_lo=0, n_hi=9):
    return [rng.randint(lo, hi) for _ in range(rng.randint(n_lo, n_hi))]


def _list_inputs(rng, lo=0, hi=20):
    """Three random lists to show, then hidden ones: the empty list, a single element and three random lists."""
    rand = lambda: (_ints(rng, lo, hi, 2, 8),)
    return [rand() for _ in range(N_SHOWN)] + [([],), ([rng.randint(lo, hi)],)] + [rand() for _ in range(N_HIDDEN - 2)]


def _kth(xs, k):
    d = sorted(set(xs), reverse=True)
    return d[k - 1] if len(d) >= k else None


def _shift(s, k):
    return "".join(LETTERS[(LETTERS.index(c) + k) % 26] if c in LETTERS else c for c in s)


def _fizz(n, p):
    out = []
    for i in range(1, n + 1):
        w = (p["wa"] if i % p["a"] == 0 else "") + (p["wb"] if i % p["b"] == 0 else "")
        out.append(w or i)
    return out


def _longest_run(xs, t):
    best = cur = 0
    for x in xs:
        cur = cur + 1 if x > t else 0
        best = max(best, cur)
    return best


def _words(rng, n_lo=0, n_hi=6):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(n_lo, n_hi)))


def _pal(rng, c):
    half = "".join(rng.choice("abcde") for _ in range(rng.randint(1, 4)))
    s = half + rng.choice(["", rng.choice("abcde")]) + half[::-1]
    if rng.random() < 0.4:
        s = list(s)
        s[rng.randrange(len(s))] = rng.choice("xyz")
        s = "".join(s)
    pos = sorted(rng.sample(range(len(s) + 1), rng.randint(0, 2)))
    for i in reversed(pos):
        s = s[:i] + c + s[i:]
    return s


FAMILIES = (
    Family("sum_multiples", "xs", lambda r: {"k": r.randint(2, 7)},
           lambda p: f"returns the sum of the elements of xs that are divisible by {p['k']}",
           lambda p: f"Add up every element whose remainder modulo {p['k']} is zero.",
           lambda p: f"    return sum(x for x in xs if x % {p['k']} == 0)",
           lambda p: lambda xs: sum(x for x in xs if x % p["k"] == 0),
           lambda r, p: _list_inputs(r, 0, 30)),
    Family("count_above", "xs", lambda r: {"t": r.randint(0, 20)},
           lambda p: f"returns how many elements of xs are greater than {p['t']}",
           lambda p: f"Count the elements that are strictly greater than {p['t']}.",
           lambda p: f"    return sum(1 for x in xs if x > {p['t']})",
           lambda p: lambda xs: sum(1 for x in xs if x > p["t"]),
           lambda r, p: _list_inputs(r, 0, 30)),
    Family("scale_small", "xs", lambda r: {"t": r.randint(3, 15), "m": r.randint(2, 5)},
           lambda p: f"returns a new list with each element of xs that is less than {p['t']}, multiplied by "
                     f"{p['m']}, in the original order",
           lambda p: f"Keep the elements below {p['t']} and multiply each kept element by {p['m']}.",
           lambda p: f"    return [x * {p['m']} for x in xs if x < {p['t']}]",
           lambda p: lambda xs: [x * p["m"] for x in xs if x < p["t"]],
           lambda r, p: _list_inputs(r, 0, 25)),
    Family("running_totals", "xs", lambda r: {"s": r.randint(0, 10)},
           lambda p: f"returns the running totals of xs starting from {p['s']}: the i-th output is {p['s']} plus "
                     f"the sum of the first i + 1 elements",
           lambda p: f"Keep a running total that starts at {p['s']} and record it after adding each element.",
           lambda p: f"    out, total = [], {p['s']}\n    for x in xs:\n        total += x\n        out.append(total)\n"
                     f"    return out",
           lambda p: lambda xs: [p["s"] + sum(xs[:i + 1]) for i in range(len(xs))],
           lambda r, p: _list_inputs(r, -5, 15)),
    Family("kth_largest", "xs", lambda r: {"k": r.randint(1, 3)},
           lambda p: f"returns the {ORDINAL[p['k']]} distinct value in xs, or None if xs has fewer than {p['k']} "
                     f"distinct values",
           lambda p: f"Sort the distinct values in decreasing order and take position {p['k']} if it exists.",
           lambda p: f"    values = sorted(set(xs), reverse=True)\n    return values[{p['k'] - 1}] "
                     f"if len(values) >= {p['k']} else None",
           lambda p: lambda xs: _kth(xs, p["k"]),
           lambda r, p: _list_inputs(r, 0, 9)),
    Family("count_letters", "s", lambda r: {"ls": "".join(sorted(r.sample(LETTERS, r.randint(2, 4))))},
           lambda p: f"returns how many characters of the string s are one of the letters {p['ls']!r}",
           lambda p: f"Count the characters of s that appear in {p['ls']!r}.",
           lambda p: f"    return sum(1 for ch in s if ch in {p['ls']!r})",
           lambda p: lambda s: sum(1 for ch in s if ch in p["ls"]),
           lambda r, p: [(_words(r, 1, 5),) for _ in range(N_SHOWN)] + [("",)]
           + [("".join(r.choice(p["ls"] + "xyz") for _ in range(r.randint(1, 9))),) for _ in range(N_HIDDEN - 1)]),
    Family("shift_letters", "s", lambda r: {"k": r.randint(1, 25)},
           lambda p: f"returns s with every lowercase letter moved {p['k']} places forward in the alphabet, "
                     f"wrapping around from 'z' to 'a', and every other character unchanged",
           lambda p: f"Shift each letter's index by {p['k']} modulo 26 and leave other characters alone.",
           lambda p: f"    out = []\n    for ch in s:\n        if 'a' <= ch <= 'z':\n"
                     f"            out.append(chr((ord(ch) - ord('a') + {p['k']}) % 26 + ord('a')))\n"
                     f"        else:\n            out.append(ch)\n    return ''.join(out)",
           lambda p: lambda s: _shift(s, p["k"]),
           lambda r, p: [(_words(r, 1, 3),) for _ in range(N_SHOWN)] + [("",), ("xyz",), ("a-b c!",)]
           + [(_words(r, 1, 4),) for _ in range(N_HIDDEN - 3)]),
    Family("is_palindrome", "s", lambda r: {"c": r.choice([" ", "-", "_", "."])},
           lambda p: f"returns True if s reads the same forwards and backwards once every {p['c']!r} is removed, "
                     f"and False otherwise",
           lambda p: f"Remove every {p['c']!r}, then compare the string with its reverse.",
           lambda p: f"    t = s.replace({p['c']!r}, '')\n    return t == t[::-1]",
           lambda p: lambda s: s.replace(p["c"], "") == s.replace(p["c"], "")[::-1],
           lambda r, p: [(_pal(r, p["c"]),) for _ in range(N_SHOWN + N_HIDDEN - 2)] + [("",), (p["c"] + "ab",)]),
    Family("digit_power_sum", "n", lambda r: {"k": r.randint(1, 3)},
           lambda p: f"returns the sum of the decimal digits of the non-negative integer n, each raised to the "
                     f"power {p['k']}",
           lambda p: f"Take the digits one at a time with % 10 and // 10 and add each digit ** {p['k']}.",
           lambda p: f"    total = 0\n    while n > 0:\n        total += (n % 10) ** {p['k']}\n        n //= 10\n"
                     f"    return total",
           lambda p: lambda n: sum(int(d) ** p["k"] for d in str(n)) if n else 0,
           lambda r, p: [(r.randint(10, 9999),) for _ in range(N_SHOWN)] + [(0,), (7,), (10 ** r.randint(2, 5),)]
           + [(r.randint(10, 10 ** 6),) for _ in range(N_HIDDEN - 3)]),
    Family("fizz_words", "n", lambda r: dict(zip(("a", "b"), r.sample(range(2, 8), 2)), **dict(
        zip(("wa", "wb"), r.sample(FIZZ, 2)))),
           lambda p: f"returns the list of the numbers from 1 to n, where multiples of {p['a']} are replaced by "
                     f"{p['wa']!r}, multiples of {p['b']} by {p['wb']!r}, and multiples of both by "
                     f"{p['wa'] + p['wb']!r}",
           lambda p: "Build each entry from the words whose divisor divides i, falling back to i itself.",
           lambda p: f"    out = []\n    for i in range(1, n + 1):\n        w = ''\n        if i % {p['a']} == 0:\n"
                     f"            w += {p['wa']!r}\n        if i % {p['b']} == 0:\n            w += {p['wb']!r}\n"
                     f"        out.append(w if w else i)\n    return out",
           lambda p: lambda n: _fizz(n, p),
           lambda r, p: [(r.randint(1, 12),) for _ in range(N_SHOWN)] + [(0,), (p["a"] * p["b"],)]
           + [(r.randint(1, 20),) for _ in range(N_HIDDEN - 2)]),
    Family("gap_differences", "xs", lambda r: {"g": r.randint(1, 3)},
           lambda p: f"returns the list of xs[i + {p['g']}] - xs[i] for every index i where xs[i + {p['g']}] exists",
           lambda p: f"Subtract each element from the element {p['g']} positions after it.",
           lambda p: f"    return [xs[i + {p['g']}] - xs[i] for i in range(len(xs) - {p['g']})]",
           lambda p: lambda xs: [xs[i + p["g"]] - xs[i] for i in range(len(xs) - p["g"])],
           lambda r, p: _list_inputs(r, 0, 20)),
    Family("chunk_sums", "xs", lambda r: {"k": r.randint(2, 5)},
           lambda p: f"splits xs into consecutive chunks of {p['k']} elements (the last chunk may be shorter) and "
                     f"returns the list of the chunk sums",
           lambda p: f"Step through xs {p['k']} elements at a time and sum each slice.",
           lambda p: f"    return [sum(xs[i:i + {p['k']}]) for i in range(0, len(xs), {p['k']})]",
           lambda p: lambda xs: [sum(xs[i:i + p["k"]]) for i in range(0, len(xs), p["k"])],
           lambda r, p: _list_inputs(r, 0, 20)),
    Family("long_word_lengths", "s", lambda r: {"k": r.randint(0, 5)},
           lambda p: f"returns, in order, the lengths of the words of s (words are separated by single spaces) "
                     f"that have more than {p['k']} letters",
           lambda p: f"Split on spaces and keep the lengths greater than {p['k']}.",
           lambda p: f"    return [len(w) for w in s.split(' ') if len(w) > {p['k']}]",
           lambda p: lambda s: [len(w) for w in s.split(" ") if len(w) > p["k"]],
           lambda r, p: [(_words(r, 1, 6),) for _ in range(N_SHOWN + N_HIDDEN - 1)] + [("",)]),
    Family("longest_run_above", "xs", lambda r: {"t": r.randint(0, 10)},
           lambda p: f"returns the length of the longest run of consecutive elements of xs that are all greater "
                     f"than {p['t']} (0 if there is none)",
           lambda p: f"Track the current run of elements above {p['t']}, reset it at other elements, keep the max.",
           lambda p: f"    best = cur = 0\n    for x in xs:\n        cur = cur + 1 if x > {p['t']} else 0\n"
                     f"        best = max(best, cur)\n    return best",
           lambda p: lambda xs: _longest_run(xs, p["t"]),
           lambda r, p: _list_inputs(r, 0, 20)),
    Family("rotate_left", "xs", lambda r: {"k": r.randint(1, 6)},
           lambda p: f"returns xs rotated left by {p['k']} positions (elements that fall off the front go to the "
                     f"end, wrapping around as many times as needed); an empty list stays empty",
           lambda p: f"Reduce {p['k']} modulo the length and join the two slices.",
           lambda p: f"    if not xs:\n        return []\n    k = {p['k']} % len(xs)\n    return xs[k:] + xs[:k]",
           lambda p: lambda xs: xs[p["k"] % len(xs):] + xs[:p["k"] % len(xs)] if xs else [],
           lambda r, p: _list_inputs(r, 0, 20)),
    Family("alternating_sum", "xs", lambda r: {"m": r.randint(1, 4)},
           lambda p: f"returns the sum of the elements at even indices minus {p['m']} times the sum of the "
                     f"elements at odd indices",
           lambda p: f"Sum xs[0::2] and xs[1::2] separately and combine them with weight {p['m']}.",
           lambda p: f"    return sum(xs[0::2]) - {p['m']} * sum(xs[1::2])",
           lambda p: lambda xs: sum(xs[0::2]) - p["m"] * sum(xs[1::2]),
           lambda r, p: _list_inputs(r, -10, 20)),
)
FAMILY_BY_NAME = {f.fname: f for f in FAMILIES}


def _call(fname: str, args: tuple) -> str:
    return f"{fname}({', '.join(repr(a) for a in args)})"


# The harness appended after the candidate's code. It prints one marker line: JSON of the repr of each result
# (None for an exception or an unsupported type); the parent compares them with the expected reprs.
_HARNESS = """

import json as _orl_json
import sys as _orl_sys

class _OrlSink:  # the candidate's own prints go nowhere, so they cannot push the result line out of the output
    def write(self, s):
        return len(s)

    def flush(self):
        pass

def _orl_plain(v, depth=0):
    if depth > 20:
        return False
    if type(v) in (int, str, bool, type(None)):
        return True
    if type(v) in (list, tuple):
        return all(_orl_plain(x, depth + 1) for x in v)
    if type(v) is dict:
        return all(_orl_plain(k, depth + 1) and _orl_plain(x, depth + 1) for k, x in v.items())
    return False

_orl_results = []
_orl_stdout = _orl_sys.stdout
for _orl_args in {inputs!r}:
    _orl_sys.stdout = _OrlSink()
    try:
        _orl_v = {fname}(*_orl_args)
        _orl_results.append(repr(_orl_v) if _orl_plain(_orl_v) else None)
    except Exception:
        _orl_results.append(None)
    finally:
        _orl_sys.stdout = _orl_stdout
print()
print({marker!r} + _orl_json.dumps(_orl_results))
"""

_BLOCK = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str | None:
    """The last ```python fenced block of a response, else its last fenced block of any language, else None."""
    if not isinstance(response, str):
        return None
    blocks = _BLOCK.findall(response)
    if not blocks:
        return None
    py = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    code = (py or [code for _, code in blocks])[-1]
    return code if code.strip() and len(code) <= 4 * MAX_ANSWER_CHARS else None


class CodeFunctionTask(Task):
    name = "code_function"

    def __init__(self, timeout_s: float = VERIFY_TIMEOUT_S):
        self.timeout_s = timeout_s  # wall clock per candidate (its 8 calls together)

    def _draw(self, rng: random.Random):
        fam = rng.choice(FAMILIES)
        p = fam.params(rng)
        return f"{fam.fname}:{sorted(p.items())}", (fam, p, fam.inputs(rng, p))

    def _build(self, draft) -> Example:
        fam, p, inputs = draft
        fn = fam.fn(p)
        expected = [fn(*(json.loads(json.dumps(a)))) for a in inputs]  # fresh copies: fn must not see shared lists
        shown = "\n".join(f"{_call(fam.fname, a)} == {e!r}" for a, e in zip(inputs[:N_SHOWN], expected))
        prompt = (f"Write a Python function `{fam.fname}({fam.args})` that {fam.describe(p)}.\n\nExamples:\n{shown}\n\n"
                  f"{FORMAT_INSTRUCTION}")
        code = f"def {fam.fname}({fam.args}):\n{fam.body(p)}\n"
        solution = f"{fam.explain(p)}\n\n```python\n{code}```"
        return Example(prompt=prompt, solution=solution, answer=code, task=self.name,
                       meta={"function": fam.fname, "inputs": [list(a) for a in inputs],
                             "expected": [repr(e) for e in expected]})

    def _program(self, example: Example, code: str, marker: str) -> str:
        inputs = [tuple(a) for a in example.meta["inputs"]]
        return code + _HARNESS.format(inputs=inputs, fname=example.meta["function"], marker=marker)

    def verify(self, example: Example, response: str) -> bool:
        return self.verify_many([example], [response])[0]

    def verify_many(self, examples: Sequence[Example], responses: Sequence[str]) -> list[bool]:
        if len(examples) != len(responses):
            raise ValueError(f"{len(examples)} examples but {len(responses)} responses")
        marker = f"__orl_results_{secrets.token_hex(8)}__:"
        jobs = [(i, self._program(e, c, marker)) for i, (e, r) in enumerate(zip(examples, responses))
                if (c := extract_code(r)) is not None]
        ok = [False] * len(examples)
        results = sandbox.run_many([p for _, p in jobs], timeout_s=self.timeout_s,
                                   max_output_bytes=sandbox.FILE_SIZE_LIMIT_BYTES)
        for (i, _), res in zip(jobs, results):
            ok[i] = _passed(res, marker, examples[i].meta["expected"])
        return ok


def _passed(res: sandbox.SandboxResult, marker: str, expected: list[Any]) -> bool:
    if res.timed_out:
        return False
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(marker)]
    if not lines:
        return False
    try:
        got = json.loads(lines[-1][len(marker):])
    except ValueError:
        return False
    return isinstance(got, list) and got == list(expected)
