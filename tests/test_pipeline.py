"""grain pipeline: packing with segment ids / positions, shuffling, epochs, host sharding, exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("grain")

from orl_jax.data.pipeline import make_dataset, segment_mask  # noqa: E402

SEQ = 16


def examples(n: int = 24, seed: int = 0) -> list[dict]:
    """Example i has tokens [1000 + i, i*10 + 1, i*10 + 2, ...] so every packed segment can be traced back."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n_tok in enumerate(rng.integers(2, 11, n)):
        toks = np.concatenate([[1000 + i], i * 10 + 1 + np.arange(n_tok - 1)]).astype(np.int32)
        out.append({"tokens": toks, "loss_mask": (np.arange(n_tok) > 0).astype(np.int32)})
    return out


def segments(batch: dict) -> list[int]:
    """Example ids of the segments of a batch, checking each is one whole, correctly positioned example."""
    ids = []
    for row in range(batch["tokens"].shape[0]):
        seg, pos, tok = batch["segment_ids"][row], batch["positions"][row], batch["tokens"][row]
        assert np.all(tok[seg == 0] == 0) and np.all(pos[seg == 0] == 0)
        for s in np.unique(seg[seg > 0]):
            where = np.flatnonzero(seg == s)
            assert np.array_equal(where, np.arange(where[0], where[-1] + 1)), "segment is not contiguous"
            np.testing.assert_array_equal(pos[where], np.arange(len(where)))
            ids.append(int(tok[where[0]]) - 1000)
            ref = examples()[ids[-1]]
            np.testing.assert_array_equal(tok[where], ref["tokens"])
            np.testing.assert_array_equal(batch["loss_mask"][row][where], ref["loss_mask"])
    return ids


def take(it, n):
    return [next(it) for _ in range(n)]


def test_packing_keeps_examples_whole_and_covers_an_epoch():
    ds = make_dataset(examples(), seq_len=SEQ, batch_size=1, num_packing_bins=4, num_epochs=1, seed=1)
    batches = list(ds)
    assert all(b["tokens"].shape == (1, SEQ) and b["tokens"].dtype == np.int32 for b in batches)
    assert set(batches[0]) == {"tokens", "loss_mask", "segment_ids", "positions"}
    ids = [i for b in batches for i in segments(b)]
    assert sorted(ids) == list(range(24))
    assert len(batches) < 24  # several examples share a row
    assert ids != sorted(ids)  # shuffled


def test_batches_shuffle_and_epochs():
    mk = lambda seed: make_dataset(examples(), seq_len=SEQ, batch_size=4, seed=seed, pack=False, num_epochs=2)
    a, b, c = list(mk(0)), list(mk(0)), list(mk(5))
    assert len(a) == 12 and a[0]["tokens"].shape == (4, SEQ)
    ids_a = [i for x in a for i in segments(x)]
    assert ids_a == [i for x in b for i in segments(x)]  # same seed, same stream
    assert ids_a != [i for x in c for i in segments(x)]
    first, second = ids_a[:24], ids_a[24:]
    assert sorted(first) == sorted(second) == list(range(24)) and first != second  # reshuffled per epoch
    row = a[0]
    n = int(row["segment_ids"][0].sum())
    np.testing.assert_array_equal(row["positions"][0][:n], np.arange(n))


def test_host_sharding_is_disjoint():
    kw = dict(seq_len=SEQ, batch_size=1, pack=False, num_epochs=1, shard_count=3)
    parts = [[i for b in make_dataset(examples(), shard_index=k, **kw) for i in segments(b)] for k in range(3)]
    assert sorted(sum(parts, [])) == list(range(24))
    assert all(len(p) == 8 for p in parts)


@pytest.mark.parametrize("prefetch", [0, 3])
def test_state_round_trip_resumes_exactly(prefetch):
    ds = make_dataset(examples(), seq_len=SEQ, batch_size=2, seed=7, prefetch=prefetch)  # infinite, packed
    it = iter(ds)
    first = take(it, 5)
    state = json.loads(json.dumps(it.get_state()))  # what the checkpoint stores
    expected = take(it, 9)  # crosses an epoch boundary
    fresh = iter(make_dataset(examples(), seq_len=SEQ, batch_size=2, seed=7, prefetch=prefetch))
    fresh.set_state(state)
    for a, b in zip(expected, take(fresh, 9)):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    plain = take(iter(make_dataset(examples(), seq_len=SEQ, batch_size=2, seed=7, prefetch=0)), 14)
    for a, b in zip(first + expected, plain):  # prefetching never changes the stream
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_truncation_and_errors():
    long = [{"tokens": np.arange(1, 40, dtype=np.int32)}]
    b = next(iter(make_dataset(long, seq_len=SEQ, batch_size=1)))
    np.testing.assert_array_equal(b["tokens"][0], np.arange(1, SEQ + 1))
    with pytest.raises(ValueError, match="truncate"):
        next(iter(make_dataset(long, seq_len=SEQ, batch_size=1, truncate=False)))
    with pytest.raises(ValueError, match="seq_len"):
        make_dataset(examples(), seq_len=0, batch_size=1)
    with pytest.raises(ValueError, match="prefetch"):
        make_dataset(examples(), seq_len=SEQ, batch_size=1, prefetch=-1)
    with pytest.raises(ValueError, match="shard_index"):
        make_dataset(examples(), seq_len=SEQ, batch_size=1, shard_index=3, shard_count=3)
    with pytest.raises(ValueError, match="reserved"):
        make_dataset([{"tokens": np.ones(3, np.int32), "segment_ids": np.ones(3, np.int32)}], seq_len=8,
                     batch_size=1)
    with pytest.raises(ValueError, match="1-D integer"):
        make_dataset([{"tokens": np.ones((2, 3), np.int32)}], seq_len=8, batch_size=1)
    with pytest.raises(TypeError, match="source"):
        make_dataset({"tokens": [1, 2]}, seq_len=8, batch_size=1)


def test_segment_mask():
    seg = np.array([[1, 1, 2, 2, 2, 0]])
    m = np.asarray(segment_mask(seg))[0]
    assert m[1, 0] and not m[0, 1] and not m[2, 1] and m[4, 2] and not m[5].any() and not m[:, 5].any()
    full = np.asarray(segment_mask(seg, causal=False))[0]
    assert full[0, 1] and full[2, 4] and not full[0, 2]
