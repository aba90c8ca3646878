"""`orl-jax` command line.

  orl-jax convert --hf DIR --out DIR [--dtype bfloat16]     HF checkpoint -> orbax params export
  orl-jax convert --orbax DIR --out DIR [--tokenizer DIR]   orbax params export -> HF checkpoint
"""

from __future__ import annotations

import argparse
import sys


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
