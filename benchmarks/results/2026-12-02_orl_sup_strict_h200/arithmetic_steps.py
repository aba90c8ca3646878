"""Session 27: how many verified arithmetic rollouts of the h200 base contain a wrong "a op b = c" line (the
verifier reads only the "####" answer, so such a line would be a verified target for L_pred). Rolls out as the
recipe's ORL rounds do (fill threshold THRESHOLD, temperature 1, 4 responses per prompt) on the arithmetic prompts
among the first N training prompts of round 0.

Run from the repository root on CPU (25-50 s), with the base package in .carry/pkg_h200_mask:
  python benchmarks/results/2026-12-02_orl_sup_strict_h200/arithmetic_steps.py 64 0.9
Output: 16 arithmetic prompts; threshold 0.9: verified 52/64, none with a wrong equation (0 of 180 wrong);
threshold 0.999: verified 59/64, none (0 of 212).
"""
import re
import sys

sys.path[:0] = ["benchmarks"]

from base_rollouts import load_base, roll_out  # noqa: E402

N, THR = int(sys.argv[1]), float(sys.argv[2])
r, tok, cfg, params = load_base()
exs, rows, out, texts, ok, sampler = roll_out(r, tok, cfg, params, N, THR, task="arithmetic")
print("arithmetic prompts", len(exs))
EQ = re.compile(r"(-?\d+)\s*([-+*/])\s*(-?\d+)\s*=\s*(-?\d+)")
ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
       "/": lambda a, b: a // b if b else None}
bad_resp = eqs = bad_eqs = 0
for text, good in zip(texts, ok):
    if not good:
        continue
    wrong = [m for m in EQ.finditer(text) if ops[m[2]](int(m[1]), int(m[3])) != int(m[4])]
    eqs += len(EQ.findall(text))
    bad_eqs += len(wrong)
    bad_resp += bool(wrong)
    if wrong and bad_resp <= 3:
        print("--- verified with a wrong step:", [w[0] for w in wrong])
        print(text[:400])
print(f"threshold {THR}: verified {sum(ok)}/{len(ok)}; of those, {bad_resp} have a wrong equation "
      f"({bad_eqs} of {eqs} equations wrong)")
