"""Embedded tasks: reference solutions verify, corruptions do not, splits are disjoint, generation is deterministic;
the sandbox enforces its time, memory, process and network limits."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import socket
import subprocess
import sys
import time

import pytest

from orl_jax.data.tasks import SPLITS, TASKS, sample, verify, verify_many
from orl_jax.data.tasks import sandbox as sb
from orl_jax.data.tasks.base import canonical_output, extract_final_answer, parse_int, parse_int_list, split_of
from orl_jax.data.tasks.code import CodeFunctionTask
from orl_jax.data.tasks.lists import ListOpsTask

# Samples per split for the verifier tests (the code task pays one sandboxed process per response).
N_VERIFY = {"arithmetic": 300, "list_ops": 300, "program_output": 300, "code_function": 100, "list_ops_short": 300}
N_DISJOINT = {"arithmetic": 3000, "list_ops": 3000, "program_output": 1500, "code_function": 3000,
              "list_ops_short": 3000}

_CACHE: dict = {}


def examples(task: str, split: str, n: int, start: int = 0):
    key = (task, split, n, start)
    if key not in _CACHE:
        _CACHE[key] = TASKS[task].generate_many(range(start, start + n), split)
    return _CACHE[key]


def with_final(ex, answer: str) -> str:
    """The reference solution with its final answer line replaced."""
    head = ex.solution.rsplit("####", 1)[0]
    return f"{head}#### {answer}"


# --- reference solutions and corruptions --------------------------------------------------------------------------

@pytest.mark.parametrize("task", sorted(TASKS))
def test_reference_solutions_verify(task):
    for split in SPLITS:
        exs = examples(task, split, N_VERIFY[task])
        assert all(e.task == task and e.split == split for e in exs)
        ok = TASKS[task].verify_many(exs, [e.solution for e in exs])
        bad = [e for e, o in zip(exs, ok) if not o]
        assert not bad, f"{task}/{split}: {len(bad)} reference solutions rejected, e.g.\n{bad[0]}"


def _wrong_answers(task: str, ex, rng: random.Random) -> list[str]:
    """Final answers that must be rejected."""
    a = ex.answer
    if task == "arithmetic":
        n = int(a)
        return [str(n + 1), str(n - 1), str(n * 10 + 1), f"{n}.5", f"-{n}" if n else "1", f"{n} {n}"]
    if task.startswith("list_ops"):
        xs = parse_int_list(a)
        i = rng.randrange(len(xs))
        perturbed = xs[:i] + [xs[i] + rng.choice([-1, 1])] + xs[i + 1:]
        out = [str(perturbed), str(xs[:-1]), str(xs + [0]), a[:-1], a[1:]]
        if xs != xs[::-1]:
            out.append(str(xs[::-1]))
        return out
    # program_output: perturb the printed value (numbers +-1, a changed character), truncate it
    m = list(re.finditer(r"-?\d+", a))
    if m:
        t = rng.choice(m)
        changed = a[:t.start()] + str(int(t.group()) + 1) + a[t.end():]
    else:
        i = rng.randrange(len(a))
        changed = a[:i] + ("Q" if a[i] != "Q" else "R") + a[i + 1:]
    out = [changed, a + "0", a + " " + a]
    if len(a) > 1:
        out.append(a[:-1])
    if a in ("True", "False"):
        out.append(str(int(a == "True")))
    return out


@pytest.mark.parametrize("task", ["arithmetic", "list_ops", "program_output", "list_ops_short"])
def test_corrupted_final_answers_rejected(task):
    rng = random.Random(0)
    t = TASKS[task]
    for split in SPLITS:
        for ex in examples(task, split, N_VERIFY[task])[:150]:
            responses = [with_final(ex, w) for w in _wrong_answers(task, ex, rng)]
            lines = ex.solution.splitlines()
            responses += [
                "",  # empty
                "\n".join(lines[:-1]),  # truncated before the final answer
                ex.solution[: len(ex.solution) // 2],  # truncated in the middle
                with_final(ex, ""),  # empty final answer
                ex.solution.replace("####", "###"),  # no marker
            ]
            for r in responses:
                assert not t.verify(ex, r), f"{task}: accepted a corrupted response for\n{ex.prompt}\n---\n{r}"


def test_final_answer_parsing_is_whitespace_tolerant_and_value_strict():
    ex = TASKS["arithmetic"].generate(0, "train")
    n = ex.answer
    good = [f"#### {n}", f"####{n}", f"####   {n}  \n", f"work\n#### {n}\n", f"#### 1\n#### {n}", f"####\n{n}",
            f"so the answer is \\boxed{{{n}}}", f"#### {n}.", f"#### ${n}", f"\t#### {n}\t"]
    for r in good:
        assert verify(ex, r), r
    for r in [f"#### {n}.0", f"#### {n} apples", f"#### {n}\n#### 1", f"{n}", f"#### {int(n) + 1}", f"#### +{n}x"]:
        assert not verify(ex, r), r
    assert parse_int("1,234") == 1234 and parse_int("12,34") is None and parse_int("-7") == -7
    assert parse_int_list("[ 1,2 ,  -3 ]") == [1, 2, -3] and parse_int_list("[]") == []
    assert parse_int_list("[1, 2") is None and parse_int_list("1, 2") is None and parse_int_list("[1.0]") is None
    assert extract_final_answer("no answer here") is None and extract_final_answer("#### ") is None
    assert canonical_output("[1,2]") == canonical_output(" [1, 2] ") != canonical_output("(1, 2)")
    assert canonical_output("1") != canonical_output("True") and canonical_output("a  b") == canonical_output("a b")
    assert canonical_output("{'a':1}") == canonical_output("{'a': 1}")
    for other in ("00", "0x0", "+0", "0.0", "0_0", "False", "'0'"):
        assert canonical_output(other) != canonical_output("0"), other
    assert canonical_output("[-3, 'a b']") == canonical_output("[ -3,'a b' ]") != canonical_output("[-3, 'ab']")


def test_list_answers_compare_elementwise():
    ex = examples("list_ops", "train", 300)[0]
    xs = parse_int_list(ex.answer)
    assert verify(ex, "#### [" + ",".join(map(str, xs)) + "]")
    assert verify(ex, "#### [ " + " ,  ".join(map(str, xs)) + " ]")


def test_short_lists_are_one_operation_on_a_few_digits_and_split_with_list_ops():
    for split in SPLITS:
        for ex in examples("list_ops_short", split, 300):
            start = parse_int_list(re.search(r"(\[[^\]]*\])", ex.prompt).group(1))
            assert 3 <= len(start) <= 5 and all(0 <= x <= 9 for x in start), ex.prompt
            assert ex.prompt.count("\n1. ") == 1 and "\n2. " not in ex.prompt, ex.prompt
    # an instance both list tasks can draw (5 digits up to 9, one operation) lands in the same split in both
    short, full = TASKS["list_ops_short"], TASKS["list_ops"]
    keys = [short._draw(random.Random(f"probe/{i}"))[0] for i in range(400)]
    splits = [short.split_of_instance(k) for k in keys]
    assert splits == [full.split_of_instance(k) for k in keys] and set(splits) == set(SPLITS)
    for bad, match in [(dict(ops=("sort_asc", "shuffle")), "ops"), (dict(ops=()), "ops"),
                       (dict(lengths=(4, 3)), "lengths"), (dict(highs=(0,)), "highs"),
                       (dict(ops=("reverse",), op_weights=(1, 1)), "op_weights")]:
        with pytest.raises(ValueError, match=match):
            ListOpsTask("x", **bad)


def test_code_task_rejects_wrong_truncated_and_hostile_candidates():
    exs = examples("code_function", "train", 100)[:12] + examples("code_function", "heldout", 100)[:8]
    task = CodeFunctionTask(timeout_s=1.0)
    bad, expect = [], []
    for ex in exs:
        fname, code = ex.meta["function"], ex.answer
        header = code.splitlines()[0]
        bad += [
            "",  # empty
            ex.solution[: ex.solution.index("```python") + 20],  # truncated inside the code block (no closing fence)
            f"```python\n{header}\n    return None\n```",  # wrong
            ex.solution.replace(code, code.rsplit("\n", 2)[0] + "\n"),  # last line of the body cut off
            f"```python\n{header}\n    pass\n```",
        ]
        expect += [False] * 5
    assert task.verify_many([e for e in exs for _ in range(5)], bad) == expect

    ex = exs[1]
    fname = ex.meta["function"]
    hostile = [
        # prints a fake all-pass result line and exits before the harness runs
        f"```python\nimport sys\nprint('__orl_results_0__:' + '[]')\nsys.exit(0)\ndef {fname}(*a):\n    return 0\n```",
        # returns an object that claims to equal everything
        f"```python\nclass E:\n    def __eq__(self, o):\n        return True\n    def __repr__(self):\n"
        f"        return {ex.meta['expected'][0]!r}\ndef {fname}(*a):\n    return E()\n```",
        # never returns (killed by the timeout)
        f"```python\ndef {fname}(*a):\n    while True:\n        pass\n```",
    ]
    # a correct function that prints a lot while it runs still passes (its prints are discarded)
    noisy = ex.answer.replace("):\n", "):\n    print('debug ' * 20000)\n", 1)
    t0 = time.monotonic()
    assert task.verify_many([ex] * (len(hostile) + 1), hostile + [f"```python\n{noisy}```"]) == \
        [False] * len(hostile) + [True]
    assert time.monotonic() - t0 < 3 * (task.timeout_s + 2)


# --- splits, determinism, sampler ---------------------------------------------------------------------------------

@pytest.mark.parametrize("task", sorted(TASKS))
def test_train_and_heldout_are_disjoint(task):
    n = N_DISJOINT[task]
    train = {e.prompt for e in examples(task, "train", n)}
    held = {e.prompt for e in examples(task, "heldout", n)}
    assert len(train) > 0.9 * n and len(held) > 0.9 * n  # the generators have real variety
    assert not train & held


def test_split_is_a_function_of_the_instance():
    # generate() redraws until the instance's hash lands in the requested split: check the hash, not just prompts
    exs = examples("program_output", "train", 300) + examples("program_output", "heldout", 300)
    assert all(split_of(f"program_output/{e.meta['program']}") == e.split for e in exs)
    with pytest.raises(ValueError, match="split"):
        TASKS["arithmetic"].generate(0, "test")
    with pytest.raises(ValueError, match="index"):
        TASKS["arithmetic"].generate(-1, "train")


@pytest.mark.parametrize("task", sorted(TASKS))
def test_generation_is_deterministic(task):
    t = TASKS[task]
    for split in SPLITS:
        a = t.generate_many([0, 5, 123456789], split)
        b = [t.generate(i, split) for i in (0, 5, 123456789)]
        assert a == b
        assert a[0] != a[1] and a[0].index == 0 and a[2].index == 123456789


def test_generation_is_deterministic_across_processes():
    # a different PYTHONHASHSEED must not change anything (no iteration over unordered sets of strings)
    code = ("import json; from orl_jax.data.tasks import TASKS; print(json.dumps([TASKS[n].generate(i, s).to_dict() "
            "for n in sorted(TASKS) for s in ('train', 'heldout') for i in (1, 77)]))")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED=str(seed))).stdout for seed in (1, 2)]
    here = [TASKS[n].generate(i, s).to_dict() for n in sorted(TASKS) for s in SPLITS for i in (1, 77)]
    assert json.loads(outs[0]) == json.loads(outs[1]) == json.loads(json.dumps(here))


def test_sample_mixes_tasks_reproducibly():
    a = sample("train", 48, seed=3)
    assert len(a) == 48 and {e.task for e in a} == set(TASKS) and all(e.split == "train" for e in a)
    assert a == sample("train", 48, seed=3)
    assert a != sample("train", 48, seed=4)
    b = sample("heldout", 10, seed=3, tasks=["list_ops", "arithmetic"])
    assert {e.task for e in b} <= {"list_ops", "arithmetic"} and all(e.split == "heldout" for e in b)
    assert all(verify_many(a, [e.solution for e in a]))
    assert sample("train", 0, seed=0) == []
    with pytest.raises(ValueError, match="unknown task"):
        sample("train", 2, 0, tasks=["nope"])
    with pytest.raises(ValueError, match="split"):
        sample("valid", 2, 0)


def test_examples_are_plain_data():
    for e in sample("train", 8, seed=0):
        d = e.to_dict()
        assert json.loads(json.dumps(d)) == d
        assert dataclasses.replace(e) == e
        assert e.answer.strip() in e.solution
        if e.task != "code_function":
            assert e.solution.endswith(f"#### {e.answer}")


# --- sandbox ------------------------------------------------------------------------------------------------------

def test_sandbox_returns_stdout_and_errors():
    r = sb.run_python("xs = [3, 1, 2]\nprint(sorted(xs), sum(xs))\nprint('done')")
    assert r.ok and r.stdout == "[1, 2, 3] 6\ndone\n" and r.stderr == "" and not r.timed_out
    r = sb.run_python("print('before')\nraise ValueError('boom')")
    assert r.returncode == 1 and r.stdout == "before\n" and "ValueError: boom" in r.stderr and not r.ok
    assert 'File "<sandbox>", line 2' in r.stderr
    r = sb.run_python("import sys; sys.exit(3)")
    assert r.returncode == 3
    r = sb.run_python("def f(:\n")
    assert r.returncode == 1 and "SyntaxError" in r.stderr
    r = sb.run_python("import os; print(sorted(os.environ))")
    assert r.stdout.strip() == "[]" or "LC_CTYPE" in r.stdout  # empty env (Python may coerce the C locale)
    rs = sb.run_many([f"print({i} * {i})" for i in range(6)], max_workers=2)
    assert [r.stdout for r in rs] == [f"{i * i}\n" for i in range(6)]


@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\ntime.sleep(60)"])
def test_sandbox_enforces_time_limit(code):
    t0 = time.monotonic()
    r = sb.run_python(code, timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert r.timed_out and not r.ok and r.returncode is not None and r.returncode < 0
    assert elapsed < 1.0 + 1.5, elapsed


def test_sandbox_enforces_memory_limit():
    r = sb.run_python("x = bytearray(600 * 1024 * 1024)\nprint('allocated')", memory_mb=256)
    assert not r.ok and "allocated" not in r.stdout and "MemoryError" in r.stderr
    r = sb.run_python("x = bytearray(50 * 1024 * 1024)\nprint(len(x))", memory_mb=256)
    assert r.ok and r.stdout.strip() == str(50 * 1024 * 1024)


def test_sandbox_blocks_processes_and_escape_modules():
    for code in ["import os; os.fork()", "import os; os.system('true')", "import subprocess",
                 "import ctypes", "import multiprocessing", "import os; os.kill(1, 0)", "import importlib"]:
        r = sb.run_python(code)
        assert r.returncode == 1 and ("PermissionError" in r.stderr or "ImportError" in r.stderr), (code, r)


def test_sandbox_limits_output_and_files():
    r = sb.run_python("print('x' * (10 ** 7))", max_output_bytes=1000)
    assert len(r.stdout) <= 1000 and not r.ok  # the 4 MB file-size limit stops the write
    r = sb.run_python("open('f.txt', 'w').write('y' * (10 ** 7))")
    assert not r.ok and "File too large" in r.stderr
    r = sb.run_python("open('g.txt', 'w').write('ok'); print(open('g.txt').read())")
    assert r.ok and r.stdout == "ok\n"  # the scratch directory is writable


def test_sandbox_output_is_read_from_its_own_descriptors(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET")
    secret.chmod(0o600)
    code = f"import os\nos.unlink('.stdout')\nos.symlink({str(secret)!r}, '.stdout')\nprint('hi')"
    r = sb.run_python(code)
    assert "SECRET" not in r.stdout + r.stderr


@pytest.fixture()
def listener():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    yield srv
    srv.close()


def _accepted(srv) -> bool:
    try:
        conn, _ = srv.accept()
    except TimeoutError:
        return False
    conn.close()
    return True


def test_sandbox_blocks_network(listener):
    port = listener.getsockname()[1]
    attempts = {
        "connect": f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('CONNECTED')",
        "socket": f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('CONNECTED')",
        "raw": f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('CONNECTED')",
        "dns": "import socket\nprint('RESOLVED', socket.getaddrinfo('localhost', 80))",
        "dns2": "import socket\nprint('RESOLVED', socket.gethostbyname('example.com'))",
        "urllib": "import urllib.request\nprint('CONNECTED')",
    }
    for name, code in attempts.items():
        r = sb.run_python(code, timeout_s=5)
        assert not r.ok and "CONNECTED" not in r.stdout and "RESOLVED" not in r.stdout, (name, r)
    assert not _accepted(listener)


@pytest.mark.skipif(not sb.network_namespace_available(), reason="no network namespace on this host")
def test_sandbox_network_namespace_stops_a_guard_bypass(listener):
    # Undo the Python-level guard (the real socket type is still reachable as a subclass of object): the empty
    # network namespace still has nowhere to connect to.
    port = listener.getsockname()[1]
    code = (
        "import socket\n"
        "raw = [c for c in object.__subclasses__() if c.__name__ == 'socket'][0]\n"
        "s = raw(2, 1)\n"
        "s.settimeout(2)\n"
        f"s.connect(('127.0.0.1', {port}))\n"
        "print('CONNECTED')\n"
    )
    r = sb.run_python(code, timeout_s=5)
    assert r.network_namespace and "CONNECTED" not in r.stdout and "unreachable" in r.stderr, r
    assert not _accepted(listener)


def test_sandbox_rejects_bad_arguments():
    with pytest.raises(TypeError):
        sb.run_python(b"print(1)")
    with pytest.raises(ValueError, match="timeout_s"):
        sb.run_python("print(1)", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        sb.run_python("print(1)", memory_mb=1)
