"""`orl-jax` command line.

  orl-jax convert --hf DIR --out DIR [--dtype bfloat16]     HF checkpoint -> orbax params export
  orl-jax convert --orbax DIR --out DIR [--tokenizer DIR]   orbax params export -> HF checkpoint
  orl-jax generate --model DIR --prompt TEXT [...]           stream a block-diffusion generation
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _convert(args) -> int:
    from orl_jax import checkpoint
    from orl_jax.convert import hf

    if bool(args.hf) == bool(args.orbax):
        raise SystemExit("orl-jax convert: give exactly one of --hf DIR or --orbax DIR")
    if args.hf:
        cfg, params = hf.load_hf(args.hf, dtype=args.dtype, allow_pickle=args.allow_pickle)
        out = checkpoint.save_params(args.out, cfg, params, overwrite=args.overwrite)
    else:
        cfg, params = checkpoint.load_params(args.orbax, dtype=args.dtype)
        out = hf.save_hf(args.out, cfg, params, tokenizer_dir=args.tokenizer, overwrite=args.overwrite)
    n = sum(x.size for x in __import__("jax").tree.leaves(params))
    print(f"wrote {out} ({n / 1e6:.2f} M params, {cfg.dtype})")
    return 0


def _generate(args) -> int:
    from orl_jax import runtime

    runtime.configure()
    import jax

    from orl_jax import checkpoint
    from orl_jax.convert import hf
    from orl_jax.data.prompt_format import format_prompt, stop_token_ids
    from orl_jax.data.tokenizer import load_tokenizer
    from orl_jax.decode.engine import generate
    from orl_jax.decode.residual import NoResidual, ORLResidual, RCDResidual
    from orl_jax.diffusion_gemma_config import DiffusionGemmaConfig
    from orl_jax.model import diffusion_gemma_inference

    model = args.model
    if (Path(model) / "params").exists():
        cfg, params = checkpoint.load_params(model, dtype=args.dtype)
    else:
        cfg, params = hf.load_hf(model, dtype=args.dtype or "bfloat16")
    if isinstance(cfg, DiffusionGemmaConfig):  # its experts in the fused kernel's layout on a GPU (inference only)
        params = diffusion_gemma_inference.inference_params(params, cfg, donate=True)  # the loaded params go
    tok = load_tokenizer(args.tokenizer or model)
    # the prompt and stop tokens exactly as the recipe trains and evaluates them (data/prompt_format.py)
    ids = tok.encode(args.prompt) if args.raw else format_prompt(tok, args.prompt)
    if args.noise:
        cfg = cfg.replace(noise=args.noise, mask_token_id=cfg.mask_token_id or tok.mask_token_id)
    options = {k: v for k, v in (("threshold", args.threshold), ("edit_threshold", args.edit_threshold),
                                 ("temperature", args.temperature)) if v is not None}
    if cfg.noise == "uniform" and "temperature" in options:
        options["t_max"] = options.pop("temperature")
    name = args.residual
    if name == "auto":  # a uniform-family model with an adapter was trained with self-conditioning (ORL form)
        name = "orl" if cfg.noise == "uniform" and getattr(cfg, "has_adapter", False) else "none"
    residual = {"none": NoResidual(), "rcd": RCDResidual(), "orl": ORLResidual()}[name]
    stops = tuple(dict.fromkeys(stop_token_ids(tok) + tuple(cfg.eos_token_ids or ())))
    out = generate(params, cfg, [list(ids)], key=jax.random.key(args.seed), max_new_tokens=args.max_new_tokens,
                   block_length=args.block_length, residual=residual, eos_token_id=stops,
                   streamer=lambda block, i: print(tok.decode(block[0], skip_special_tokens=True), end="",
                                                   flush=True),
                   **options)
    print(f"\n[{int(out.lengths[0])} tokens, {int(out.forwards[0])} denoising + {int(out.commits)} commit forwards,"
          f" TPF {float(out.tpf[0]):.2f}; {cfg.noise} noise, residual {name}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="orl-jax", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="convert between HF checkpoints and orbax params exports")
    c.add_argument("--hf", help="input: Hugging Face checkpoint directory")
    c.add_argument("--orbax", help="input: orl_jax orbax params export")
    c.add_argument("--out", required=True, help="output directory")
    c.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="parameter dtype (default: bfloat16 from HF, the saved dtype from orbax)")
    c.add_argument("--tokenizer", help="copy tokenizer files from this directory into an HF output")
    c.add_argument("--allow-pickle", action="store_true", help="allow reading pickle .bin checkpoints")
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(fn=_convert)
    g = sub.add_parser("generate", help="generate text with a block-diffusion model, streaming each block")
    g.add_argument("--model", required=True, help="HF checkpoint directory or orbax params export")
    g.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", action="store_true",
                   help="encode the prompt as is (default: the chat template, as the recipe formats its prompts)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--block-length", type=int, default=None)
    g.add_argument("--noise", choices=["uniform", "mask"], default=None, help="override the model's noise mode")
    g.add_argument("--threshold", type=float, default=None, help="mask family: fill threshold")
    g.add_argument("--edit-threshold", type=float, default=None, help="mask family: edit threshold (LLaDA 2.1)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--residual", choices=["auto", "none", "rcd", "orl"], default="auto",
                   help="residual context; auto: the ORL form (self-conditioning) for a uniform-family model with an "
                        "adapter, none otherwise")
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(fn=_generate)
    args = ap.parse_args(argv)
    if args.cmd == "convert" and args.hf and args.dtype is None:
        args.dtype = "bfloat16"
    try:
        return args.fn(args)
    except (ValueError, TypeError) as e:
        print(f"orl-jax {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
