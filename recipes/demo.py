"""`make demo`: the end-to-end path that exists today, with no downloads.

1. Train a small BPE tokenizer (tokenizers) and build a small random Qwen3ForCausalLM with transformers; save both
   as a Hugging Face directory, the same layout as a real Qwen3 checkpoint.
2. Load it through orl_jax's real loader, check the causal logits against transformers, export to orbax and back.
3. Run it as QwenDLM: generate() with the uniform-state sampler and with the mask-token sampler (+ residual
   context), streaming each finished block, and print the statistics.
Random weights produce random text: this shows the machinery, not a trained model (the trainer recipe will).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orl_jax import runtime  # noqa: E402

runtime.configure(compilation_cache_dir=None)

import jax  # noqa: E402
import numpy as np  # noqa: E402

CORPUS = [
    "Tom has 3 apples and buys 4 more. How many apples does he have? 3 + 4 = 7. The answer is 7.",
    "Sort the list [5, 2, 9] in ascending order: [2, 5, 9].",
    "def f(x): return x * 2  # f(21) prints 42",
] * 20


def build_hf_dir(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>", "<mask>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", mask_token="<mask>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=fast.eos_token_id)
    Qwen3ForCausalLM(cfg).save_pretrained(out)


def main() -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    from orl_jax import checkpoint
    from orl_jax.convert import hf
    from orl_jax.data.tokenizer import load_tokenizer, mask_token_id
    from orl_jax.decode.engine import generate
    from orl_jax.decode.residual import ORLResidual, RCDResidual
    from orl_jax.model import qwen3

    work = Path(tempfile.mkdtemp(prefix="orl_jax_demo_"))
    hf_dir = work / "hf"
    build_hf_dir(hf_dir)
    tok = load_tokenizer(hf_dir)
    cfg, params = hf.load_hf(hf_dir, dtype="float32")
    print(f"[1] loaded {hf_dir}: {sum(x.size for x in jax.tree.leaves(params)):,} params, vocab {cfg.vocab_size}")

    ids = np.array([tok.encode("Tom has 3 apples and buys 4 more.")])
    with torch.no_grad():
        ref = Qwen3ForCausalLM.from_pretrained(hf_dir).eval()(torch.tensor(ids)).logits.numpy()
    err = np.abs(np.asarray(qwen3.forward(params, cfg, ids)) - ref).max()
    print(f"[2] causal logits vs transformers: max abs error {err:.2e}")
    assert err < 1e-4
    checkpoint.save_params(work / "orbax", cfg, params)
    cfg2, params2 = checkpoint.load_params(work / "orbax")
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)))
    hf.save_hf(work / "hf_again", cfg2, params2, tokenizer_dir=hf_dir)
    print(f"[2] orbax export + HF re-export round trip OK ({work})")

    prompts = [tok.encode("Sort the list [5, 2, 9]"), tok.encode("Tom has 3 apples")]
    dlm = cfg.replace(adapter_hidden=32, block_length=8)
    dlm_params = dict(params, adapter=jax.tree.map(lambda s: s, _fresh_adapter(dlm)))

    def show(block, i):
        print(f"    block {i}: " + " | ".join(repr(tok.decode(row)) for row in block))

    for name, c, kw in [
        ("uniform (DiffusionGemma sampler) + ORL residual", dlm,
         dict(residual=ORLResidual(), max_denoising_steps=12)),
        ("mask tokens, fill threshold 0.9 + RCD residual", dlm.replace(noise="mask", mask_token_id=mask_token_id(tok)),
         dict(residual=RCDResidual(), threshold=0.9)),
    ]:
        t = time.perf_counter()
        out = generate(dlm_params, c, prompts, key=jax.random.key(0), max_new_tokens=24, streamer=show, **kw)
        print(f"[3] {name}: {time.perf_counter() - t:.1f}s incl. compile; forwards/row {np.asarray(out.forwards)}, "
              f"commits {int(out.commits)}, steps/block {np.asarray(out.steps_per_block)}, "
              f"TPF {np.round(np.asarray(out.tpf), 2)}")
    print("demo finished")


def _fresh_adapter(cfg):
    from orl_jax import params as P
    from orl_jax.model import qwen3

    return P.init(qwen3.param_specs(cfg)["adapter"], jax.random.key(1))


if __name__ == "__main__":
    main()
