"""A toy bigram LM with dropout and an adapter group, shared by the optimizer and loop tests."""

import jax
import jax.numpy as jnp

from orl_jax import params as P

V, D = 32, 8
TOY_SPECS = {
    "embed": P.ParamSpec((V, D), jnp.float32, ("vocab", "embed")),
    "norm": P.ParamSpec((D,), jnp.float32, ("embed",), P.ones),
    "adapter": {"w": P.ParamSpec((D, D), jnp.float32, ("embed", "adapter"))},
}


def toy_loss(params, batch, key):
    """Mean next-token NLL over loss_mask; NaN when the mask is empty (a poisoned batch)."""
    x = params["embed"][batch["tokens"]] * params["norm"][None, None]  # [B, L, D]
    x = x + jnp.tanh(x @ params["adapter"]["w"])
    x = x * jax.random.bernoulli(key, 0.9, x.shape) / 0.9
    logp = jax.nn.log_softmax(x @ params["embed"].T, axis=-1)
    nll = -jnp.take_along_axis(logp[:, :-1], batch["tokens"][:, 1:, None], axis=-1)[..., 0]
    m = batch["loss_mask"][:, 1:].astype(jnp.float32)
    return (nll * m).sum() / m.sum(), {"targets": m.sum()}
