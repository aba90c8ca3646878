"""The carry of generate()'s device-side loop, and what generate() returns."""

from __future__ import annotations

import jax
from flax import struct

from orl_jax.model.cache import KVCache


@struct.dataclass
class DecodeState:
    tokens: jax.Array  # [B, T] generated tokens (T = blocks * L); pad after EOS
    canvas: jax.Array  # [B, L] the active block's canvas
    sampler: dict  # sampler-specific carry (see decode/samplers.py)
    z: jax.Array  # [B, L, D] residual for the next step (soft embedding of the last step; 0 at a block start)
    a: jax.Array  # [B, L] normalized entropy of the last step (RCD weight; 0 at a block start)
    cache: KVCache  # committed prefix
    block: jax.Array  # [] int32 index of the active block
    step: jax.Array  # [] int32 denoising step inside the block
    block_done: jax.Array  # [B] bool: row finished denoising this block
    seq_done: jax.Array  # [B] bool: row hit EOS in an earlier block
    key: jax.Array  # PRNG key
    forwards: jax.Array  # [B] int32 denoising forwards that ran while the row was active
    total_forwards: jax.Array  # [] int32 denoising forwards run (batch-wide)
    commits: jax.Array  # [] int32 commit forwards run
    steps_per_block: jax.Array  # [blocks] int32
    capture: dict | None = None  # capture mode only: per-step records, see engine.py
    prev_h: jax.Array | None = None  # [B, D] logit_shift models: the last committed token's hidden state


@struct.dataclass
class GenerateOutput:
    tokens: jax.Array  # [B, T] new tokens; pad_token_id after the first EOS and in unused blocks
    lengths: jax.Array  # [B] valid new tokens (through the EOS, if any)
    forwards: jax.Array  # [B] denoising forwards while the row was active
    total_forwards: jax.Array  # [] denoising forwards run
    commits: jax.Array  # [] commit forwards run (one per block that later blocks read)
    steps_per_block: jax.Array  # [blocks]
    tpf: jax.Array  # [B] valid tokens / (denoising forwards + commit forwards)
    tpf_hf: jax.Array  # [B] non-pad tokens / denoising forwards: transformers' DiffusionGemma tokens_per_forward
    capture: dict | None = None
