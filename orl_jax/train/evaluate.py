"""Held-out evaluation: accuracy (task verifiers), tokens per forward and tokens/s, for AR and diffusion decoding,
plus the markdown report and the accuracy-vs-TPF plot. Every number comes from the run that calls this.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import numpy as np

from orl_jax.data import tasks
from orl_jax.data.prompt_format import format_prompt, response_until_stop, stop_token_ids
from orl_jax.decode.ar import ar_generate
from orl_jax.decode.engine import generate


@dataclass
class EvalRow:
    method: str  # e.g. "AR", "QwenDLM", "QwenDLM+ORL"
    setting: str  # the decoding knob, e.g. "entropy_bound=0.3"
    accuracy: float
    tpf: float  # valid tokens / (denoising + commit forwards); AR: 1
    tokens_per_s: float  # valid tokens / wall time of the batched decode (after compilation)
    n: int
    per_task: dict[str, float] | None = None  # accuracy of each task's examples
    hits: list[int] | None = None  # 1 / 0 per example, in the examples' order (for paired comparisons)


def _batches(xs, size):
    for i in range(0, len(xs), size):
        yield xs[i:i + size]


def evaluate(params, cfg, tokenizer, examples: Sequence, *, method: str, setting: str, max_new_tokens: int,
             batch_size: int = 16, seed: int = 0, ar: bool = False, on_output=None, **generate_kwargs) -> EvalRow:
    """Decode every example's prompt, verify the responses, measure TPF and speed. on_output(rows, out, n): called
    with each batch's prompt rows (padded to batch_size with copies of the last), its generate() output and its
    number of real rows (benchmarks/block_confidence.py replays the captured states)."""
    stops = stop_token_ids(tokenizer)
    correct, tokens_total, forwards_total, seconds = 0, 0, 0, 0.0
    hits: dict[str, list[bool]] = {}
    each: list[int] = []
    key = jax.random.key(seed)
    for batch in _batches(list(examples), batch_size):
        prompts = [format_prompt(tokenizer, ex.prompt) for ex in batch]
        rows = prompts + [prompts[-1]] * (batch_size - len(prompts))  # fixed batch: one compiled program
        key, k = jax.random.split(key)
        def run(rows=rows, k=k):
            if ar:
                return ar_generate(params, cfg, rows, max_new_tokens=max_new_tokens, eos_token_id=stops)
            return generate(params, cfg, rows, key=k, max_new_tokens=max_new_tokens, eos_token_id=stops,
                            **generate_kwargs)

        if seconds == 0.0:
            jax.block_until_ready(run())  # compile outside the timing
        t = time.perf_counter()
        out = jax.block_until_ready(run())
        seconds += time.perf_counter() - t
        if on_output is not None:
            on_output(rows, out, len(batch))
        toks = np.asarray(out[0] if ar else out.tokens)[:len(batch)]
        for ex, row in zip(batch, toks):
            resp = response_until_stop(tokenizer, row)
            ok = bool(tasks.verify(ex, tokenizer.decode(resp, skip_special_tokens=True)))
            correct += ok
            each.append(int(ok))
            hits.setdefault(ex.task, []).append(ok)
            n_tok = min(len(resp) + 1, len(row))
            tokens_total += n_tok
            if ar:  # a row's own decoding costs one forward per token (steps after its EOS are batch padding)
                forwards_total += n_tok
        if not ar:
            forwards_total += int(np.sum(np.asarray(out.forwards)[:len(batch)])) + int(out.commits) * len(batch)
    n = len(examples)
    return EvalRow(method=method, setting=setting, accuracy=correct / max(n, 1),
                   tpf=tokens_total / max(forwards_total, 1), tokens_per_s=tokens_total / max(seconds, 1e-9), n=n,
                   per_task={t: float(np.mean(v)) for t, v in sorted(hits.items())}, hits=each)


def paired_vs_base(rows: Sequence[EvalRow], base: str) -> list[dict]:
    """Each other method's accuracy against `base` at the same setting, on the same examples: the difference with
    a 95% interval from the per-example paired differences (+-1.96 standard errors), and the TPF ratio. Paired,
    the interval is narrower than from two independent accuracies (on 256 examples ~+-5 points each), since both
    methods see the same prompts."""
    bases = {r.setting: r for r in rows if r.method == base and r.hits is not None}
    out = []
    for r in rows:
        b = bases.get(r.setting)
        if r.method == base or b is None or r.hits is None or len(r.hits) != len(b.hits):
            continue
        d = np.asarray(r.hits, float) - np.asarray(b.hits, float)
        se = float(np.std(d, ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
        out.append({"method": r.method, "setting": r.setting, "delta": float(d.mean()), "ci95": 1.96 * se,
                    "tpf_ratio": r.tpf / b.tpf})
    return out


def tpf_at_matched_accuracy(rows: Sequence[EvalRow], base: str, slack: float = 0.01) -> list[dict]:
    """Issue #6's acceptance view. Reference: `base` at its most accurate setting (accuracy A0, TPF T0; the higher
    TPF on ties). For each diffusion method (the base included): its highest TPF among settings with accuracy >=
    A0 - slack, that setting, and the ratio to T0 (None where no setting is that accurate)."""
    ref_rows = [r for r in rows if r.method == base]
    if not ref_rows:
        return []
    ref = max(ref_rows, key=lambda r: (r.accuracy, r.tpf))
    methods = list(dict.fromkeys(r.method for r in rows if r.setting != "-"))  # AR rows have no setting
    out = []
    for m in methods:
        ok = [r for r in rows if r.method == m and r.accuracy >= ref.accuracy - slack - 1e-9]
        best = max(ok, key=lambda r: r.tpf) if ok else None
        out.append({"method": m, "setting": best.setting if best else None, "accuracy": best.accuracy if best else None,
                    "tpf": best.tpf if best else None, "tpf_ratio": best.tpf / ref.tpf if best else None,
                    "reference": {"setting": ref.setting, "accuracy": ref.accuracy, "tpf": ref.tpf}})
    return out


def write_report(rows: Sequence[EvalRow], out_dir: str | Path, title: str, notes: Sequence[str] = (),
                 base: str | None = None) -> Path:
    """report.md (table; with `base`, also each method paired against it: paired_vs_base), results.jsonl and
    accuracy_vs_tpf.png in out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(asdict(r)) + "\n")
    task_names = sorted({t for r in rows for t in (r.per_task or {})})
    lines = [f"# {title}", "", *notes, "",
             "| method | setting | accuracy | TPF | tokens/s | n |" + "".join(f" {t} |" for t in task_names),
             "|---|---|---|---|---|---|" + "---|" * len(task_names)]
    for r in rows:
        per = r.per_task or {}
        lines.append(f"| {r.method} | {r.setting} | {100 * r.accuracy:.1f}% | {r.tpf:.2f} | {r.tokens_per_s:.0f} "
                     f"| {r.n} |" + "".join(f" {100 * per[t]:.0f}% |" if t in per else " - |" for t in task_names))
    paired = paired_vs_base(rows, base) if base else []
    if paired:
        lines += ["", f"Against {base} at the same setting, on the same examples (paired 95% interval):", "",
                  "| method | setting | accuracy difference | TPF ratio |", "|---|---|---|---|"]
        lines += [f"| {p['method']} | {p['setting']} | {100 * p['delta']:+.1f} +- {100 * p['ci95']:.1f} points "
                  f"| {p['tpf_ratio']:.2f}x |" for p in paired]
    matched = tpf_at_matched_accuracy(rows, base) if base else []
    if matched:
        ref = matched[0]["reference"]
        lines += ["", f"Highest TPF at accuracy >= {base}'s best - 1 point ({100 * ref['accuracy']:.1f}% at "
                  f"{ref['setting']}, TPF {ref['tpf']:.2f}):", "",
                  "| method | setting | accuracy | TPF | vs the reference |", "|---|---|---|---|---|"]
        lines += [f"| {m['method']} | {m['setting']} | {100 * m['accuracy']:.1f}% | {m['tpf']:.2f} | "
                  f"{m['tpf_ratio']:.2f}x |" if m["setting"] else f"| {m['method']} | none that accurate | | | |"
                  for m in matched]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    plot_accuracy_vs_tpf(rows, out / "accuracy_vs_tpf.png", title)
    return out / "report.md"


def plot_accuracy_vs_tpf(rows, path, title, ylim=(-2, 102)):
    """One accuracy-vs-TPF curve per method of `rows` (EvalRow), written as a PNG (also benchmarks/frontier_plot.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r.method for r in rows):
        pts = sorted((r.tpf, 100 * r.accuracy) for r in rows if r.method == method)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_ylim(*ylim)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
