"""The report stage: metrics of a score file, a per-task table, a JSON summary and a plot.

Counted rows are those scored, plus those whose generation failed (as no answer); skipped and
unjudged rows are left out and reported apart. With n samples of task i, c_i of them correct:

- pass@1 = mean over tasks of c_i / n_i ("pass@1 averaged over samples");
- its standard error two ways: across runs (a run = one (seed, sample index); the standard
  deviation of the runs' accuracies over sqrt(runs), as NeMo-Skills and sgl-eval report it) and
  across tasks (the standard deviation of the per-task rates over sqrt(tasks): the error of the
  question sample itself);
- pass@k = mean over tasks of 1 - C(n_i - c_i, k) / C(n_i, k) (the unbiased estimator), for k in
  1, 2, 4, ... up to the fewest samples of a task;
- majority@k: the most frequent answer among a task's first k samples (ties: the one given first)
  is right;
- no-answer rate: counted rows without an extractable answer.
"""
from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from deepinfer.eval.scoring import Score


class TaskResult(BaseModel):
    task_id: str
    samples: int
    correct: int
    pass_rate: float
    majority: str | None
    expected: str
    no_answer: int


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn from n (c correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority(scores: list[Score]) -> tuple[str | None, bool]:
    """(the most frequent answer, whether it is right); ties go to the answer given first."""
    answers = [s.answer for s in scores if s.answer is not None]
    if not answers:
        return None, False
    counts = Counter(answers)
    top = max(counts.values())
    winner = next(a for a in answers if counts[a] == top)
    verdicts = [s.correct for s in scores if s.answer == winner]
    return winner, sum(verdicts) * 2 > len(verdicts)


def _ks(n: int) -> list[int]:
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if n > 0 and ks[-1] != n:
        ks.append(n)
    return ks


def summarize(scores: list[Score]) -> dict[str, Any]:
    """The metrics of one benchmark's scores (see the module docstring) and the per-task table."""
    counted = [s for s in scores if s.status in ("scored", "error")]
    by_task: dict[str, list[Score]] = defaultdict(list)
    for s in counted:
        by_task[s.task_id].append(s)
    for samples in by_task.values():
        samples.sort(key=lambda s: (s.seed, s.sample))
    tasks = []
    for task_id, samples in by_task.items():
        winner, _ = majority(samples)
        c = sum(s.correct for s in samples)
        tasks.append(TaskResult(task_id=task_id, samples=len(samples), correct=c, pass_rate=c / len(samples),
                                majority=winner, expected=samples[0].expected,
                                no_answer=sum(s.answer is None for s in samples)))
    runs: dict[tuple[int, int], list[bool]] = defaultdict(list)
    for s in counted:
        runs[(s.seed, s.sample)].append(s.correct)
    run_accuracy = [sum(v) / len(v) for v in runs.values()]
    rates = [t.pass_rate for t in tasks]
    fewest = min((t.samples for t in tasks), default=0)
    statuses = Counter(s.status for s in scores)
    return {
        "benchmark": scores[0].benchmark if scores else None,
        "tasks": len(tasks), "rows": len(scores), "counted": len(counted),
        "samples_per_task": {"min": fewest, "max": max((t.samples for t in tasks), default=0)},
        "pass@1": statistics.fmean(rates) if rates else None,
        "pass@1_sem_runs": statistics.stdev(run_accuracy) / math.sqrt(len(run_accuracy))
        if len(run_accuracy) > 1 else None,
        "pass@1_sem_tasks": statistics.stdev(rates) / math.sqrt(len(rates)) if len(rates) > 1 else None,
        "pass@k": {str(k): statistics.fmean(pass_at_k(t.samples, t.correct, k) for t in tasks) for k in _ks(fewest)},
        "majority@k": {str(k): statistics.fmean(majority(by_task[t.task_id][:k])[1] for t in tasks)
                       for k in _ks(fewest)},
        "no_answer_rate": sum(s.answer is None for s in counted) / len(counted) if counted else None,
        "truncated_rate": sum(s.finish_reason == "length" for s in counted) / len(counted) if counted else None,
        "mean_completion_tokens": statistics.fmean(s.completion_tokens for s in counted) if counted else None,
        "generation_errors": statuses.get("error", 0), "skipped": statuses.get("skipped", 0),
        "unjudged": statuses.get("unjudged", 0),
        "per_task": [t.model_dump() for t in sorted(tasks, key=lambda t: _natural(t.task_id))],
    }


def _natural(text: str) -> list:
    """A sort key that orders "aime26-2" before "aime26-10"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def format_report(summary: dict[str, Any]) -> str:
    """The per-task table and the headline metrics, as text."""
    lines = [f"{'task':<24} {'n':>4} {'correct':>7} {'pass':>8}  {'majority':<14} expected"]
    for t in summary["per_task"]:
        lines.append(f"{t['task_id'][:24]:<24} {t['samples']:>4} {t['correct']:>7} {_pct(t['pass_rate']):>8}  "
                     f"{str(t['majority'])[:14]:<14} {t['expected'][:40]}")
    sem = [f"{_pct(summary[k])} {what}" for k, what in (("pass@1_sem_runs", "across runs"),
                                                        ("pass@1_sem_tasks", "across tasks")) if summary[k] is not None]
    spt = summary["samples_per_task"]
    lines += ["",
              f"{summary['benchmark']}: {summary['tasks']} tasks, {spt['min']}"
              + (f"-{spt['max']}" if spt["max"] != spt["min"] else "") + f" samples each, {summary['counted']} rows",
              f"pass@1 {_pct(summary['pass@1'])}" + (f" ± {', ± '.join(sem)} (SEM)" if sem else ""),
              "pass@k " + ", ".join(f"@{k} {_pct(v)}" for k, v in summary["pass@k"].items()),
              "majority@k " + ", ".join(f"@{k} {_pct(v)}" for k, v in summary["majority@k"].items()),
              f"no answer {_pct(summary['no_answer_rate'])}, cut off at max tokens {_pct(summary['truncated_rate'])}"]
    if summary["generation_errors"]:
        lines.append(f"warning: {summary['generation_errors']} samples failed to generate and count as no answer; "
                     f"run `deepinfer eval generate` again to retry them")
    if summary["skipped"]:
        lines.append(f"{summary['skipped']} samples skipped (image tasks) and left out of the metrics")
    if summary["unjudged"]:
        lines.append(f"{summary['unjudged']} samples unjudged (they need --judge-endpoint, or the judge failed) and "
                     f"left out of the metrics")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> bool:
    """A bar chart of the per-task pass rates (sorted) to `path`; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tasks = sorted(summary["per_task"], key=lambda t: t["pass_rate"])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.18 * len(tasks)), 4.0))
    ax.bar(range(len(tasks)), [100 * t["pass_rate"] for t in tasks], color="tab:blue")
    if summary["pass@1"] is not None:
        ax.axhline(100 * summary["pass@1"], color="tab:red", linestyle="--", label=f"pass@1 {_pct(summary['pass@1'])}")
        ax.legend(loc="upper left")
    if len(tasks) <= 60:
        ax.set_xticks(range(len(tasks)), [t["task_id"] for t in tasks], rotation=90, fontsize=6)
    else:
        ax.set_xticks([])
    ax.set_ylim(0, 100)
    ax.set_ylabel("pass rate over samples (%)")
    ax.set_title(f"{summary['benchmark']}: per-task pass rate ({summary['tasks']} tasks)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
