"""Session 28: how far the base's verified rollout answers are from the ground-truth answers of the same prompts.

One round of the h200 base's rollouts as ORL rolls out (round 0's first 32 prompts, 4 responses each, fill 0.9,
temperature 1). For each verified response: whether its tokens equal the reference answer's (solution + end of turn)
exactly, and otherwise where they first differ and how many tokens differ (difflib), per task.

Run from the repository root on CPU (~2 minutes), with the base package in .carry/pkg_h200_mask:
  python benchmarks/results/2026-12-02_orl_truth_states_h200/answers_vs_truth.py [prompts]
"""

import difflib
import sys

sys.path[:0] = ["benchmarks"]

import numpy as np  # noqa: E402
from base_rollouts import load_base, roll_out  # noqa: E402

from orl_jax.data.prompt_format import format_example  # noqa: E402

P = int(sys.argv[1]) if len(sys.argv) > 1 else 32
r, tok, cfg, params = load_base()
exs, rows, out, texts, ok, sampler = roll_out(r, tok, cfg, params, P)
toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
stats = {}
for i, good in enumerate(ok):
    ex = exs[i // 4]
    s = stats.setdefault(ex.task, {"responses": 0, "verified": 0, "exact": 0, "diff_tokens": [], "first_diff": []})
    s["responses"] += 1
    if not good:
        continue
    s["verified"] += 1
    mine, truth = toks[i, :lens[i]].tolist(), format_example(tok, ex)[1]
    if mine == truth:
        s["exact"] += 1
        continue
    sm = difflib.SequenceMatcher(a=truth, b=mine, autojunk=False)
    s["diff_tokens"].append(max(len(truth), len(mine)) - sum(b.size for b in sm.get_matching_blocks()))
    s["first_diff"].append(next(k for k, (a, b) in enumerate(zip(truth + [-1], mine + [-2])) if a != b) / len(truth))
    if len(s["diff_tokens"]) == 1:
        print(f"[{ex.task}] first differing answer:\n  truth: {tok.decode(truth)!r}\n  mine:  {tok.decode(mine)!r}")
print("| task | responses | verified | verified answers equal to the reference | differing: median tokens differing | "
      "differing: median first difference (share of the answer) |")
print("|---|---|---|---|---|---|")
for task, s in sorted(stats.items()):
    d, f = s["diff_tokens"], s["first_diff"]
    print(f"| {task} | {s['responses']} | {s['verified']} | {s['exact']} | {np.median(d) if d else '-'} | "
          f"{f'{np.median(f):.2f}' if f else '-'} |")
