"""kernels/l2_prefetch: the request plan and its errors, the hint's wiring into the MoE (no value changes), the PTX
it assembles to (where the `triton` package is installed) and, on a GPU, the launch itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orl_jax_kernels.l2_prefetch.kernel import MAX_REQUEST, _asm, _triton_kernel, plan, prefetch_l2

STACK = (3, 8, 64, 128)  # a layer: 64 K elements, 128 KB in bf16


def test_plan_splits_the_bytes_into_requests():
    assert plan(STACK, jnp.bfloat16, 1 << 16, programs=2, chunks=4) == (8 * 64 * 128, (1 << 16) // 8 // 2)


@pytest.mark.parametrize("kwargs,match", [
    ({"shape": (64,)}, "must be \\[L, ...\\]"),
    ({"chunks": 3}, "power of two"),
    ({"programs": 0}, "programs=0"),
    ({"nbytes": 1000}, "multiple of 16"),
    ({"nbytes": 1 << 18}, "at most one layer"),
    ({"shape": (2, 4096, 1024), "nbytes": 2 << 20, "chunks": 1}, "over the 1048560"),
])
def test_plan_names_what_does_not_fit(kwargs, match):
    args = {"shape": STACK, "dtype": jnp.bfloat16, "nbytes": 1 << 16, "programs": 1, "chunks": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        plan(**args)


def test_prefetch_is_a_zero_token_off_the_gpu():
    stack = jnp.ones(STACK, jnp.bfloat16)
    token = jax.jit(lambda s, i: prefetch_l2(s, i, 1 << 16, programs=2, chunks=4))(stack, jnp.int32(1))
    assert token.shape == (2,) and token.dtype == jnp.int32 and not np.asarray(token).any()


def test_moe_fused_path_with_the_prefetch_on_gives_the_same_values(monkeypatch):
    from orl_jax.model import moe
    from orl_jax.model.streamed import StackedWeight

    ks = jax.random.split(jax.random.key(5), 4)
    t, d, e, f, k = 24, 128, 4, 64, 2
    x = jax.random.normal(ks[0], (t, d))
    gate_up, down = jax.random.normal(ks[1], (2, e, d, 2 * f)) * 0.1, jax.random.normal(ks[2], (2, e, f, d)) * 0.1
    experts = jnp.stack([jnp.arange(t, dtype=jnp.int32) % e, (jnp.arange(t, dtype=jnp.int32) + 1) % e], axis=1)
    weights = jax.nn.softmax(jax.random.normal(ks[3], (t, k)), axis=-1)
    tiles = moe.fuse_gate_up(gate_up)

    def run():
        return jax.jit(lambda g, dn: moe.experts_mlp(x, weights, experts, StackedWeight(g, jnp.int32(1)),
                                                     StackedWeight(dn, jnp.int32(1)), "gelu_tanh", "pallas"))(
            tiles, down)

    want = run()
    monkeypatch.setattr(moe, "PREFETCH_L2_BYTES", 1 << 16)
    monkeypatch.setattr(moe, "PREFETCH_L2_CHUNKS", 4)
    np.testing.assert_array_equal(np.asarray(run()), np.asarray(want))
    monkeypatch.setattr(moe, "PREFETCH_L2_BYTES", 1000)  # a size the plan refuses reaches the user as such
    with pytest.raises(ValueError, match="nbytes=1000"):
        run()


@pytest.mark.parametrize("evict_last", [False, True])
def test_assembles_for_hopper_where_triton_is_installed(evict_last):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    layer_elems, chunk_elems = plan((30, 128, 11, 2816, 128), jnp.bfloat16, 32 << 20, 1, 64)
    sig = {"w_ptr": "*bf16", "layer_ptr": "*i32", "out_ptr": "*i32"} | {
        n: "constexpr" for n in ("LAYER_ELEMS", "CHUNK_ELEMS", "CHUNKS", "ASM")}
    src = ASTSource(_triton_kernel(), signature=sig, constexprs={
        "LAYER_ELEMS": layer_elems, "CHUNK_ELEMS": chunk_elems, "CHUNKS": 64, "ASM": _asm(chunk_elems * 2, evict_last)})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 1}).asm["ptx"]
    requests = [line for line in ptx.splitlines() if "cp.async.bulk.prefetch.L2" in line]
    assert len(requests) == 2 and all(f"], {chunk_elems * 2}" in r for r in requests)  # 64 over 32 threads
    assert ("evict_last" in ptx) == evict_last and chunk_elems * 2 <= MAX_REQUEST


@pytest.mark.gpu
def test_runs_on_gpu_and_changes_no_value(monkeypatch):
    """On a GPU: the launch returns zeros, and the MoE's fused path at the 26B's expert shapes gives bit-identical
    rows with the prefetch on (32 MB, evict_last, and evict_normal from 4 programs)."""
    from orl_jax.model import moe
    from orl_jax.model.streamed import StackedWeight

    ks = jax.random.split(jax.random.key(7), 5)
    t, d, e, f, k, n_layers = 256, 2816, 128, 704, 8, 2
    x = jax.random.normal(ks[0], (t, d), jnp.bfloat16)
    tiles = moe.fuse_gate_up(jax.random.normal(ks[1], (n_layers, e, d, 2 * f), jnp.bfloat16) * 0.02)
    down = jax.random.normal(ks[2], (n_layers, e, f, d), jnp.bfloat16) * 0.02
    experts = jax.lax.top_k(jax.random.normal(ks[3], (t, e)), k)[1].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(ks[4], (t, k)), axis=-1)
    token = jax.jit(lambda s: prefetch_l2(s, jnp.int32(1), 32 << 20))(tiles)
    assert token.shape == (1,) and int(token[0]) == 0

    def run(g, dn, x, weights, experts):
        return moe.experts_mlp(x, weights, experts, StackedWeight(g, jnp.int32(1)), StackedWeight(dn, jnp.int32(1)),
                               "gelu_tanh", "pallas", distinct=True)

    args = (tiles, down, x, weights, experts)
    calls = lambda: jax.jit(run).lower(*args).as_text().count("triton_kernel_call")  # noqa: E731
    want, bare = np.asarray(jax.jit(run)(*args), np.float32), calls()
    for programs, evict_last in [(1, True), (4, False)]:
        monkeypatch.setattr(moe, "PREFETCH_L2_BYTES", 32 << 20)
        monkeypatch.setattr(moe, "PREFETCH_L2_PROGRAMS", programs)
        monkeypatch.setattr(moe, "PREFETCH_L2_EVICT_LAST", evict_last)
        assert calls() > bare  # the prefetch's launch is in the program
        np.testing.assert_array_equal(np.asarray(jax.jit(run)(*args), np.float32), want)
