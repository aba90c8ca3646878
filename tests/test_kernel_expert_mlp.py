"""The fused expert MLP kernel (gate/up, activation and down per expert in one launch) against its oracle in
interpret mode, the weight tilings against the plain layout, and its Triton IR at DiffusionGemma's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from triton_ir import verified_triton_modules

from orl_jax.model.layers import ACTIVATIONS
from orl_jax_kernels.expert_mlp.kernel import BM, Tiles, expert_mlp, tile_down, tile_gate_up
from orl_jax_kernels.expert_mlp.reference import expert_mlp_reference

GELU = ACTIVATIONS["gelu_tanh"]
TILES = Tiles(bf=32, bn=64, bk1=32, bk2=32)


def _case(key, sizes, t=21, d=128, f=96, layers=2):
    ks = jax.random.split(key, 4)
    m = int(sum(sizes))
    x = jax.random.normal(ks[0], (t, d))
    rows = jax.random.randint(ks[1], (m,), 0, t, jnp.int32)  # tokens repeat, as top-k choices do
    gate_up = jax.random.normal(ks[2], (layers, len(sizes), d, 2 * f)) * d ** -0.5
    down = jax.random.normal(ks[3], (layers, len(sizes), f, d)) * f ** -0.5
    sizes = jnp.array(sizes, jnp.int32)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes).astype(jnp.int32)])
    return x, rows, sizes, offsets, gate_up, down


def test_tilings_hold_the_plain_layouts_columns():
    gu = jnp.arange(2 * 3 * 8).reshape(2, 3, 8)  # [E, D, 2F], F = 4
    t = tile_gate_up(gu, 2)  # [E, 2, D, 4]
    np.testing.assert_array_equal(t[:, 1, :, :2], gu[:, :, 2:4])  # gate columns 2, 3
    np.testing.assert_array_equal(t[:, 1, :, 2:], gu[:, :, 6:8])  # up columns 2, 3
    dn = jnp.arange(2 * 3 * 8).reshape(2, 3, 8)  # [E, F, D]
    np.testing.assert_array_equal(tile_down(dn, 4)[:, 1], dn[:, :, 4:])
    with pytest.raises(ValueError, match="bf = 3"):
        tile_gate_up(gu, 3)
    with pytest.raises(ValueError, match="bn = 3"):
        tile_down(dn, 3)


@pytest.mark.parametrize("sizes,tiled", [([0, BM + 5, 3, 0, BM, 1, 9], True), ([1, 0, 2], True),
                                         ([0, BM + 5, 3, 0, BM, 1, 9], False)])
def test_matches_the_reference_in_interpret_mode(sizes, tiled):
    x, rows, sizes, offsets, gate_up, down = _case(jax.random.key(0), sizes)
    gu, dn = (tile_gate_up(gate_up, TILES.bf), tile_down(down, TILES.bn)) if tiled else (gate_up, down)
    got = expert_mlp(x, rows, offsets, gu, dn, jnp.int32(1), GELU, TILES, interpret=True)
    want = expert_mlp_reference(x, rows, sizes, gate_up[1], down[1], GELU)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # the check can fail: the other layer's weights give other rows
    other = expert_mlp_reference(x, rows, sizes, gate_up[0], down[0], GELU)
    assert np.abs(np.asarray(other) - np.asarray(want)).max() > 0.1


def test_bf16_in_interpret_mode():
    x, rows, sizes, offsets, gate_up, down = _case(jax.random.key(1), [7, 0, 12, 3])
    x, gate_up, down = (a.astype(jnp.bfloat16) for a in (x, gate_up, down))
    got = expert_mlp(x, rows, offsets, tile_gate_up(gate_up, TILES.bf), tile_down(down, TILES.bn), jnp.int32(0),
                     GELU, TILES, interpret=True)
    want = expert_mlp_reference(x, rows, sizes, gate_up[0], down[0], GELU)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_mismatched_tiles_are_refused():
    x, rows, sizes, offsets, gate_up, down = _case(jax.random.key(2), [3, 4])
    with pytest.raises(ValueError, match="do not match"):
        expert_mlp(x, rows, offsets, tile_gate_up(gate_up, 16), tile_down(down, TILES.bn), jnp.int32(0), GELU,
                   TILES, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        expert_mlp(x, rows, offsets, gate_up, down[..., :64], jnp.int32(0), GELU, TILES, interpret=True)
    with pytest.raises(ValueError, match="1-D int32"):
        expert_mlp(x, rows.astype(jnp.float32), offsets, tile_gate_up(gate_up, TILES.bf),
                   tile_down(down, TILES.bn), jnp.int32(0), GELU, TILES, interpret=True)


@pytest.mark.parametrize("tiled", [True, False])
def test_triton_ir_at_diffusion_gemma_shapes(tiled):
    """The 26B's experts (D 2816, F 704, 128 experts) at the default tiles lower to valid Triton IR."""
    e, d, f, m, t = 128, 2816, 704, 2048, 256
    tiles = Tiles()
    gu, dn = ((2, e, f // tiles.bf, d, 2 * tiles.bf), (2, e, d // tiles.bn, f, tiles.bn)) if tiled else (
        (2, e, d, 2 * f), (2, e, f, d))
    args = (jax.ShapeDtypeStruct((t, d), jnp.bfloat16), jax.ShapeDtypeStruct((m,), jnp.int32),
            jax.ShapeDtypeStruct((e + 1,), jnp.int32), jax.ShapeDtypeStruct(gu, jnp.bfloat16),
            jax.ShapeDtypeStruct(dn, jnp.bfloat16), jax.ShapeDtypeStruct((), jnp.int32))
    assert verified_triton_modules(lambda *a: expert_mlp(*a, GELU, tiles), *args) == 1
