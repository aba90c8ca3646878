"""What the kernel sweeps (kernels/*/bench.py) write: a JSON-lines record per variant, printed as it lands, and a
tuned table rewritten atomically after each shape, so a sweep stopped by its time limit keeps the shapes done and
never leaves a half-written table. And how the model benchmarks read such tables back (load_tables) and label their
outputs (digest)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
from pathlib import Path

import numpy as np


def recorder(path: str):
    """record(**fields): print one JSON line and append it to `path`."""
    def record(**rec):
        print(json.dumps(rec), flush=True)
        with open(path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
    return record


def write_table(path: str, table: list) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(table, fh, indent=1)
    os.replace(tmp, path)


def load_tables(log, gemm: str | None = None, attention: str | None = None) -> None:
    """Load the tuned tables given (small-M / grouped GEMM tiles; attention blocks) into the kernels before the first
    trace, and log what each holds."""
    if gemm:
        from orl_jax_kernels.small_m_gemm.kernel import load_tuned

        log(what="gemm_table", table=str(load_tuned(gemm)))
    if attention:
        from orl_jax_kernels.decode_attention.kernel import load_tuned

        log(what="attention_table", table=str(load_tuned(attention)))


def digest(x) -> str:
    """A short digest of an output array (a canvas, generated tokens): variants that must not change numerics
    (launch or loop options) must agree on it."""
    return hashlib.sha256(np.asarray(x).tobytes()).hexdigest()[:12]


def set_switch(name: str, value):
    """Set a module-level trace-time switch named 'package.module.NAME' (a benchmark's --set, or a --gemm-sweep
    entry's 'set'); its old value."""
    module, attr = name.rsplit(".", 1)
    mod = importlib.import_module(module)
    if not hasattr(mod, attr):
        raise ValueError(f"switch {name!r}: {module} has no {attr}")
    old = getattr(mod, attr)
    setattr(mod, attr, value)
    return old


def parse_switches(items) -> dict:
    """{name: value} of a benchmark's 'package.module.NAME=JSON' items (or '...=@FILE', the JSON in a file: a table a
    benchmark wrote)."""
    def parse(value: str):
        return json.loads(Path(value[1:]).read_text() if value.startswith("@") else value)

    return {name: parse(value) for name, _, value in (item.partition("=") for item in items)}


def set_switches(items) -> dict:
    """set_switch for each item of a benchmark's --set (parse_switches); {name: value}."""
    switches = parse_switches(items)
    for name, value in switches.items():
        set_switch(name, value)
    return switches


@contextlib.contextmanager
def switched(switches: dict):
    """The trace-time switches {name: value} set inside the block, their old values back after it."""
    old = {}
    try:
        for name, value in switches.items():
            old[name] = set_switch(name, value)
        yield
    finally:
        for name, value in old.items():
            set_switch(name, value)


def int_list(ap, flag: str, text: str, lo: int) -> list[int]:
    """A flag's comma-separated integers, each >= lo; otherwise the parser's usage error naming the flag."""
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        ap.error(f"{flag} takes comma-separated integers, got {text!r}")
    if any(v < lo for v in vals):
        ap.error(f"{flag} values must be >= {lo}, got {text!r}")
    return vals


def chain_lengths(ap, text: str) -> list[int]:
    """The two chain lengths of a per-kernel probe (launch_tax_probe, persistent_chain_probe, pdl_probe): 'N1,N2',
    0 < N1 < N2; the difference between their timings over N2 - N1 is the cost per link."""
    lengths = int_list(ap, "--lengths", text, 1)
    if len(lengths) != 2 or not lengths[0] < lengths[1]:
        ap.error(f"--lengths must be two increasing positive counts, got {text!r}")
    return lengths
