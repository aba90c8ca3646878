"""benchmarks/bench_io.py: records append as JSON lines; the table is replaced whole, never left half-written."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from bench_io import digest, recorder, set_switches, switched, write_table  # noqa: E402


def test_records_append_and_tables_replace(tmp_path, capsys):
    record = recorder(str(tmp_path / "r.jsonl"))
    record(shape="a", us=1.5)
    record(shape="b", error="refused")
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert [json.loads(x)["shape"] for x in lines] == ["a", "b"] and '"us": 1.5' in capsys.readouterr().out
    table = tmp_path / "t.json"
    write_table(str(table), [{"k": 1}])
    write_table(str(table), [{"k": 1}, {"k": 2}])
    assert json.loads(table.read_text()) == [{"k": 1}, {"k": 2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "t.json"]  # no temporary left behind


def test_digest_tells_arrays_apart_by_value_and_dtype():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert digest(a) == digest(a.copy()) and len(digest(a)) == 12
    b = a.copy()
    b[0, 0] = 1
    assert digest(a) != digest(b)
    assert digest(a) != digest(a.astype(np.int64))


def test_set_switches_parses_json_values_and_refuses_unknown_names(monkeypatch, tmp_path):
    from orl_jax_kernels.decode_attention import kernel

    monkeypatch.setattr(kernel, "SPLITS_IN_INPUT_DTYPE", True)
    name = "orl_jax_kernels.decode_attention.kernel.SPLITS_IN_INPUT_DTYPE"
    assert set_switches([f"{name}=false"]) == {name: False}
    assert kernel.SPLITS_IN_INPUT_DTYPE is False
    (tmp_path / "value.json").write_text("true")  # '@FILE': the JSON value read from a file
    assert set_switches([f"{name}=@{tmp_path / 'value.json'}"]) == {name: True}
    assert kernel.SPLITS_IN_INPUT_DTYPE is True
    with pytest.raises(ValueError, match="NO_SUCH_SWITCH"):
        set_switches(["orl_jax_kernels.decode_attention.kernel.NO_SUCH_SWITCH=1"])


def test_switched_restores_the_old_values_even_after_an_error():
    from orl_jax.decode import samplers

    name = "orl_jax.decode.samplers.UNNORMALIZED_PROBS"
    before = samplers.UNNORMALIZED_PROBS
    with switched({name: not before}):
        assert samplers.UNNORMALIZED_PROBS is (not before)
    assert samplers.UNNORMALIZED_PROBS is before
    with pytest.raises(RuntimeError), switched({name: not before}):
        raise RuntimeError("inside")
    assert samplers.UNNORMALIZED_PROBS is before
