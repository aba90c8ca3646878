"""Accuracy-vs-TPF curves of methods from several recipe runs on one plot (runs of one base package compare).

Each --run is LABEL=RESULTS:METHOD: the rows of METHOD in a run's results.jsonl (recipes/train_qwendlm.py writes
one per run; benchmarks/results/ keeps them), drawn as LABEL.

  python benchmarks/frontier_plot.py --out frontier.png --title "h200 base" \
      --run "base=call1_results.jsonl:QwenDLM" --run "ORL l_cert 1=call1_results.jsonl:QwenDLM+ORL (l_cert 1)"
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from orl_jax.train.evaluate import EvalRow, plot_accuracy_vs_tpf  # noqa: E402


def load_rows(spec: str) -> list[EvalRow]:
    """LABEL=RESULTS:METHOD -> that method's rows, relabelled."""
    label, sep, rest = spec.partition("=")
    path, sep2, method = rest.partition(":")
    if not (sep and sep2 and label and path and method):
        raise ValueError(f"--run must be LABEL=RESULTS:METHOD, got {spec!r}")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    picked = [r for r in rows if r["method"] == method]
    if not picked:
        raise ValueError(f"--run {spec!r}: no rows of method {method!r} in {path} "
                         f"(it has {sorted({r['method'] for r in rows})})")
    return [EvalRow(**{**r, "method": label}) for r in picked]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, metavar="LABEL=RESULTS:METHOD")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default="held-out accuracy against tokens per forward")
    ap.add_argument("--ylim", type=float, nargs=2, default=(-2, 102), metavar=("LOW", "HIGH"),
                    help="the accuracy axis (percent)")
    args = ap.parse_args(argv)
    try:
        rows = [row for spec in args.run for row in load_rows(spec)]
    except (OSError, ValueError) as e:
        ap.error(str(e))
    tmp = f"{args.out}.tmp.png"
    plot_accuracy_vs_tpf(rows, tmp, args.title, ylim=tuple(args.ylim))
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
