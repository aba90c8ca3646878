"""Predict the output of a short generated Python program.

Seven program shapes: straight-line integer arithmetic, a for loop with a branch, a list comprehension followed by
list operations, string slicing / methods, a while loop (digit sums, Euclid's gcd, Collatz steps), counting with a
dict, and a small function called in a loop. Each prints one line.

The reference answer is what the program prints when it is run in the sandbox (`sandbox.run_python`; a batch of
generated programs shares one sandboxed process, each with its own globals and captured stdout). The worked
solution is an execution trace written by the generator as it builds the program; generation fails loudly if the
trace's final value and the sandbox's output ever disagree, so every reference solution is checked against Python.

The verifier compares the final answer with the printed output as a Python literal when it is one ("[1,2]" ==
"[1, 2]", but "1" != "True") and otherwise as text with whitespace runs collapsed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

from orl_jax.data.tasks import sandbox
from orl_jax.data.tasks.base import Example, Task, canonical_output, extract_final_answer

FORMAT_INSTRUCTION = 'Trace the execution step by step, then write exactly what the program prints on the last ' \
                     'line as "#### <output>".'
WORDS = ("planet", "banana", "rocket", "garden", "silver", "python", "orange", "castle", "window", "summer",
         "bridge", "pencil", "forest", "cotton", "dragon", "lemon", "tiger", "cloud", "river", "apple")
TOKENS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tea", "sky")
VARS = ("a", "b", "c", "d", "e")
BATCH = 256  # programs per sandboxed process


def _v(x) -> str:
    """A value as it would be substituted into an expression (negative numbers parenthesized)."""
    return f"({x})" if isinstance(x, int) and x < 0 else repr(x)


def _straight_line(rng: random.Random):
    n_vars = rng.randint(3, 5)
    env, code, trace = {}, [], []
    forms = ["{x} + {y}", "{x} - {y}", "{x} * {c}", "{x} // {c}", "{x} % {c}", "{x} * {y} - {c}",
             "({x} + {c}) * {c2}", "{x} + {y} * {c}", "max({x}, {y}) - {c}", "abs({x} - {y})", "{x} * {x} - {y}"]
    for i, name in enumerate(VARS[:n_vars]):
        if i < 2:
            val = rng.randint(2, 20)
            env[name] = val
            code.append(f"{name} = {val}")
            trace.append(f"{name} = {val}")
            continue
        while True:
            form = rng.choice(forms)
            x, y = rng.choice(VARS[:i]), rng.choice(VARS[:i])
            c, c2 = rng.randint(2, 9), rng.randint(2, 5)
            expr = form.format(x=x, y=y, c=c, c2=c2)
            if ("//" in form or "%" in form) and env[x] < 0:
                continue
            val = eval(expr, {}, dict(env))  # our own generated expression over known ints
            if -500 <= val <= 5000:
                break
        subst = form.format(x=_v(env[x]), y=_v(env[y]), c=c, c2=c2)
        env[name] = val
        code.append(f"{name} = {expr}")
        trace.append(f"{name} = {expr} = {subst} = {val}")
    x, y = rng.sample(VARS[:n_vars], 2)
    final = rng.choice([f"{x} + {y}", f"{x} - {y}", f"{VARS[n_vars - 1]}", f"{x} * 2 + {y}"])
    val = eval(final, {}, dict(env))
    code.append(f"print({final})")
    trace.append(f"print({final}) prints {val}")
    return code, trace, str(val)


def _for_loop(rng: random.Random):
    s, a = rng.randint(0, 20), rng.randint(0, 6)
    b = a + rng.randint(3, 8)
    step = rng.choice([1, 1, 2])
    m, k, c = rng.randint(2, 4), rng.randint(1, 5), rng.randint(1, 6)
    branch = rng.random() < 0.7
    rng_txt = f"range({a}, {b})" if step == 1 else f"range({a}, {b}, {step})"
    code = [f"total = {s}", f"for i in {rng_txt}:"]
    if branch:
        code += [f"    if i % {m} == 0:", f"        total += i * {k}", "    else:", f"        total -= {c}"]
    else:
        code += [f"    total += i * {k} - {c}"]
    code.append("print(total)")
    trace, total = [f"total = {s}", f"i takes the values {list(range(a, b, step))}"], s
    for i in range(a, b, step):
        if branch and i % m == 0:
            new = total + i * k
            trace.append(f"i = {i}: {i} % {m} == 0, so total = {total} + {i} * {k} = {new}")
        elif branch:
            new = total - c
            trace.append(f"i = {i}: {i} % {m} = {i % m}, so total = {total} - {c} = {new}")
        else:
            new = total + i * k - c
            trace.append(f"i = {i}: total = {total} + {i} * {k} - {c} = {new}")
        total = new
    trace.append(f"print(total) prints {total}")
    return code, trace, str(total)


def _list_ops(rng: random.Random):
    xs = [rng.randint(0, 20) for _ in range(rng.randint(5, 8))]
    t, k = rng.randint(2, 12), rng.randint(2, 4)
    kind = rng.choice(["gt", "odd", "lt"])
    cond = {"gt": f"x > {t}", "odd": "x % 2 == 1", "lt": f"x < {t}"}[kind]
    keep = [x for x in xs if eval(cond, {}, {"x": x})]
    mapk = rng.choice(["mul", "add"])
    body = f"x * {k}" if mapk == "mul" else f"x + {k}"
    ys = [eval(body, {}, {"x": x}) for x in keep]
    code = [f"xs = {xs}", f"ys = [{body} for x in xs if {cond}]"]
    trace = [f"xs = {xs}", f"the elements with {cond} are {keep}", f"ys = [{body} for each of them] = {ys}"]
    extra = rng.choice(["append", "pop", "none"])
    if extra == "append":
        code.append("ys.append(len(xs))")
        ys = ys + [len(xs)]
        trace.append(f"ys.append(len(xs)) appends {len(xs)}, so ys = {ys}")
    elif extra == "pop" and ys:
        code.append("ys.pop()")
        trace.append(f"ys.pop() removes {ys[-1]}, so ys = {ys[:-1]}")
        ys = ys[:-1]
    finals = ["sorted(ys)", "sum(ys)", "ys[::-1]", "len(ys)", "ys[:3]"]
    if ys:
        finals.append("max(ys) - min(ys)")
    final = rng.choice(finals)
    val = eval(final, {}, {"ys": list(ys)})
    code.append(f"print({final})")
    trace.append(f"{final} = {val}")
    trace.append(f"print({final}) prints {val}")
    return code, trace, str(val)


def _strings(rng: random.Random):
    s = rng.choice(WORDS)
    env, code, trace = {"s": s}, [f's = "{s}"'], [f"s = {s!r}"]
    cur = "s"
    ops = ["{v}[::-1]", "{v}.upper()", "{v}[1:4]", '{v}.replace("{ch}", "{ch2}")', "{v} + {v}[:2]", "{v} * 2",
           "{v}[0] + {v}[-1]", "{v}[::2]", '"-".join({v})']
    for name in rng.sample(["t", "u", "w"], rng.randint(1, 3)):
        op = rng.choice(ops)
        ch = rng.choice(sorted(set(env[cur])))
        expr = op.format(v=cur, ch=ch, ch2=rng.choice("xyz"))
        val = eval(expr, {}, dict(env))
        if len(val) > 40 or not val:
            continue
        env[name] = val
        code.append(f"{name} = {expr}")
        trace.append(f"{name} = {expr} = {val!r}")
        cur = name
    final = rng.choice([cur, f"len({cur})", f'{cur}.count("{rng.choice(sorted(set(env[cur])))}")', f"{cur} + s[-1]"])
    val = eval(final, {}, dict(env))
    code.append(f"print({final})")
    trace.append(f"print({final}) prints {val}")
    return code, trace, str(val)


def _while_loop(rng: random.Random):
    kind = rng.choice(["digits", "gcd", "collatz"])
    if kind == "digits":
        n = rng.randint(100, 99999)
        code = [f"n = {n}", "total = 0", "while n > 0:", "    total += n % 10", "    n //= 10", "print(total)"]
        trace, total = [f"n = {n}, total = 0"], 0
        while n > 0:
            trace.append(f"digit {n % 10}: total = {total} + {n % 10} = {total + n % 10}, n = {n} // 10 = {n // 10}")
            total, n = total + n % 10, n // 10
        trace.append("n is 0, so the loop stops")
        trace.append(f"print(total) prints {total}")
        return code, trace, str(total)
    if kind == "gcd":
        g = rng.randint(2, 12)
        a, b = g * rng.randint(2, 15), g * rng.randint(2, 15)
        code = [f"a, b = {a}, {b}", "while b:", "    a, b = b, a % b", "print(a)"]
        trace = [f"a = {a}, b = {b}"]
        while b:
            trace.append(f"a, b = {b}, {a} % {b} = {a % b}")
            a, b = b, a % b
        trace.append(f"b is 0, so the loop stops and print(a) prints {a}")
        return code, trace, str(a)
    n = rng.randint(3, 40)
    cap = rng.randint(6, 20)
    code = [f"n = {n}", "steps = 0", f"while n != 1 and steps < {cap}:", "    if n % 2 == 0:", "        n = n // 2",
            "    else:", "        n = 3 * n + 1", "    steps += 1", "print(n, steps)"]
    trace, steps = [f"n = {n}, steps = 0"], 0
    while n != 1 and steps < cap:
        new = n // 2 if n % 2 == 0 else 3 * n + 1
        how = f"{n} // 2 = {new}" if n % 2 == 0 else f"3 * {n} + 1 = {new}"
        n, steps = new, steps + 1
        trace.append(f"step {steps}: n = {how}")
    trace.append("n is 1, so the loop stops" if n == 1 else f"steps reached {cap}, so the loop stops")
    trace.append(f"print(n, steps) prints {n} {steps}")
    return code, trace, f"{n} {steps}"


def _dict_count(rng: random.Random):
    vocab = rng.sample(TOKENS, rng.randint(2, 4))
    words = [rng.choice(vocab) for _ in range(rng.randint(5, 9))]
    code = [f"words = {words}", "counts = {}", "for w in words:", "    counts[w] = counts.get(w, 0) + 1"]
    counts: dict[str, int] = {}
    trace = []
    for w in words:
        trace.append(f"w = {w!r}: counts[{w!r}] = {counts.get(w, 0)} + 1 = {counts.get(w, 0) + 1}")
        counts[w] = counts.get(w, 0) + 1
    trace.append(f"counts = {counts}")
    w0 = rng.choice(sorted(counts))
    final = rng.choice(["counts", f"counts[{w0!r}] * 10 + len(counts)", "max(counts, key=counts.get)",
                        "sorted(counts.items())"])
    val = eval(final, {}, {"counts": dict(counts)})
    if final.startswith("max"):
        trace.append(f"the highest count is {max(counts.values())}; the first key with it is {val!r}")
    elif final != "counts":
        trace.append(f"{final} = {val!r}")
    code.append(f"print({final})")
    trace.append(f"print({final}) prints {val}")
    return code, trace, str(val)


def _function(rng: random.Random):
    t, k, m, k2 = rng.randint(3, 10), rng.randint(1, 6), rng.randint(2, 4), rng.randint(0, 5)
    cond = rng.choice(["x % 2 == 0", f"x > {t}"])
    vals = [rng.randint(0, 15) for _ in range(rng.randint(3, 5))]
    code = ["def f(x):", f"    if {cond}:", f"        return x // 2 + {k}", f"    return x * {m} - {k2}", "",
            "total = 0", f"for v in {vals}:", "    total += f(v)", "print(total)"]
    trace, total = ["total = 0"], 0
    for x in vals:
        if eval(cond, {}, {"x": x}):
            r = x // 2 + k
            why = f"{cond.replace('x', str(x))} is true, so f({x}) = {x} // 2 + {k} = {r}"
        else:
            r = x * m - k2
            why = f"{cond.replace('x', str(x))} is false, so f({x}) = {x} * {m} - {k2} = {r}"
        trace.append(f"v = {x}: {why}; total = {total} + {_v(r)} = {total + r}")
        total += r
    trace.append(f"print(total) prints {total}")
    return code, trace, str(total)


SHAPES = (_straight_line, _for_loop, _list_ops, _strings, _while_loop, _dict_count, _function)

_RUNNER = """import io, json, sys
_outs = []
for _src in {srcs!r}:
    _buf = io.StringIO()
    sys.stdout = _buf
    try:
        exec(compile(_src, "<program>", "exec"), {{"__name__": "__main__"}})
    except Exception as _e:
        _buf.write("<error: %r>" % (_e,))
    finally:
        sys.stdout = sys.__stdout__
    _outs.append(_buf.getvalue())
print(json.dumps(_outs))
"""


def run_programs(codes: Sequence[str], timeout_s: float = 60.0) -> list[str]:
    """stdout of each (trusted, generated) program, run in sandboxed processes, BATCH programs per process."""
    outs: list[str] = []
    for i in range(0, len(codes), BATCH):
        chunk = list(codes[i:i + BATCH])
        r = sandbox.run_python(_RUNNER.format(srcs=chunk), timeout_s=timeout_s,
                               max_output_bytes=sandbox.FILE_SIZE_LIMIT_BYTES)
        if not r.ok:
            raise RuntimeError(f"sandbox run of {len(chunk)} generated programs failed: rc={r.returncode} "
                               f"timed_out={r.timed_out}\n{r.stderr[-2000:]}")
        outs += json.loads(r.stdout)
    return outs


class ProgramOutputTask(Task):
    name = "program_output"

    def _draw(self, rng: random.Random):
        code, trace, expected = rng.choice(SHAPES)(rng)
        program = "\n".join(code) + "\n"
        return program, (program, trace, expected)

    def _build_many(self, drafts) -> list[Example]:
        outputs = run_programs([program for program, _, _ in drafts])
        examples = []
        for (program, trace, expected), out in zip(drafts, outputs):
            answer = out.strip()
            if answer != expected or "\n" in answer:
                raise RuntimeError(f"generator trace says {expected!r} but the program printed {out!r}:\n{program}")
            prompt = f"What does this Python program print?\n\n```python\n{program}```\n{FORMAT_INSTRUCTION}"
            solution = "\n".join(trace) + f"\n#### {answer}"
            examples.append(Example(prompt=prompt, solution=solution, answer=answer, task=self.name,
                                    meta={"program": program}))
        return examples

    def verify(self, example: Example, response: str) -> bool:
        got = extract_final_answer(response)
        return got is not None and canonical_output(got) == canonical_output(example.answer)
