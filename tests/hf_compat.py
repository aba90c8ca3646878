"""transformers' API where the releases the tests run on differ: the CPU install's current one and the GPU image's
5.17 (DESIGN.md: one place per difference)."""

import inspect

from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaForBlockDiffusion

# The KV cache's keyword in DiffusionGemma's calls (models, encoder, `_denoising_step`): `cache` in later 5.x
# (`past_key_values` deprecated), `past_key_values` in 5.17.
_FORWARD = inspect.signature(DiffusionGemmaForBlockDiffusion.forward).parameters
CACHE = "cache" if "cache" in _FORWARD else "past_key_values"
