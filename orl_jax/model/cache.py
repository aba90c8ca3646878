"""Static-size KV cache of the committed prefix.

Prompts are left-padded so every row writes the same slots: a block is committed at slot `length` for the whole
batch with one dynamic_update_slice, and the shapes never depend on the prompt. Row b's tokens live in slots
[start[b], length); the RoPE position of slot j is j - start[b].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: jax.Array  # [layers, B, S, K, H]
    v: jax.Array  # [layers, B, S, K, H]
    start: jax.Array  # [B] int32: first real (non-pad) slot of each row
    length: jax.Array  # [] int32: slots filled so far (shared by all rows)

    @property
    def size(self) -> int:
        return self.k.shape[2]

    @classmethod
    def empty(cls, num_layers: int, batch: int, size: int, num_kv_heads: int, head_dim: int, dtype) -> KVCache:
        z = jnp.zeros((num_layers, batch, size, num_kv_heads, head_dim), dtype)
        return cls(k=z, v=z, start=jnp.zeros((batch,), jnp.int32), length=jnp.zeros((), jnp.int32))

    def positions(self, num_tokens: int) -> jax.Array:
        """[B, L] RoPE positions of `num_tokens` tokens placed right after the filled slots."""
        return self.length - self.start[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None]

    def read(self, num_tokens: int) -> tuple[jax.Array, jax.Array]:
        """(k, v) [layers, B, num_tokens, K, H] at slot `length`: what a commit of num_tokens would overwrite."""
        at = (0, 0, self.length, 0, 0)
        size = self.k.shape[:2] + (num_tokens,) + self.k.shape[3:]
        return jax.lax.dynamic_slice(self.k, at, size), jax.lax.dynamic_slice(self.v, at, size)

    def write(self, k_new: jax.Array, v_new: jax.Array, advance: bool | jax.Array = True) -> KVCache:
        """Append [layers, B, L, K, H] at slot `length` (the commit). The caller sizes the cache so that
        length + L <= size (the engine does); past the end, XLA would clamp the slot and overwrite the tail.
        advance (a traced bool too): whether `length` moves past the written slots; False with what `read(L)` gave
        leaves the cache as it was (a write in place where a lax.cond's branches would pass the cache through)."""
        if k_new.shape[2] > self.k.shape[2]:
            raise ValueError(f"cannot write {k_new.shape[2]} tokens into a KV cache of {self.k.shape[2]} slots")
        if k_new.shape != v_new.shape or k_new.shape[:2] + k_new.shape[3:] != self.k.shape[:2] + self.k.shape[3:]:
            raise ValueError(f"k/v of shapes {k_new.shape} / {v_new.shape} do not fit a cache of shape {self.k.shape}")
        at = (0, 0, self.length, 0, 0)
        return self.replace(k=jax.lax.dynamic_update_slice(self.k, k_new.astype(self.k.dtype), at),
                            v=jax.lax.dynamic_update_slice(self.v, v_new.astype(self.v.dtype), at),
                            length=self.length + jnp.where(advance, k_new.shape[2], 0).astype(self.length.dtype))


@struct.dataclass
class HybridKVCache:
    """Two KVCache stacks for a model whose layer types differ in K/V shape (DiffusionGemma: sliding layers
    [K=8, H=256], full layers [K=2, H=512]). Both cover the same slots and share start / length."""

    sliding: KVCache  # k, v: [sliding layers, B, S, K_s, H_s]
    full: KVCache  # k, v: [full layers, B, S, K_f, H_f]

    @property
    def size(self) -> int:
        return self.full.size

    @property
    def start(self) -> jax.Array:
        return self.full.start

    @property
    def length(self) -> jax.Array:
        return self.full.length

    def positions(self, num_tokens: int) -> jax.Array:
        return self.full.positions(num_tokens)

    def read(self, num_tokens: int) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        """(sliding (k, v), full (k, v)) at slot `length`, as `write` takes them (KVCache.read)."""
        return self.sliding.read(num_tokens), self.full.read(num_tokens)

    def write(self, sliding: tuple[jax.Array, jax.Array], full: tuple[jax.Array, jax.Array],
              advance: bool | jax.Array = True) -> HybridKVCache:
        """Append each stack's (k, v) [layers, B, L, K, H] at slot `length` (the commit; KVCache.write)."""
        return HybridKVCache(sliding=self.sliding.write(*sliding, advance), full=self.full.write(*full, advance))
