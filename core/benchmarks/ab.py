"""`examples/benchmark.py --ab`: one benchmark under two settings, one fresh process per side and
round, the side that goes first alternating every round (`timing.alternating_rounds`).

Side A is the command as given. Side B is the same command with environment variables set
(`--ab NAME=VALUE`, repeatable: a back-end switch, a feature, an emulated CPU tier) and/or another
checkpoint (`--ab_model DIR`, e.g. DeepSeek-V4.1 beside V4). Each process is a whole benchmark run
(its own warm-up and `--repeats`) that appends its result record to a file of its own; a round's
figure is that run's median. Printed: each figure's median over the rounds per side, and the median
(min-max) of the per-round ratios B / A. When the sides run different checkpoints, also decode
throughput times the active parameters per token (`model_cost`), which compares the work each
side does per second rather than the tokens of models of different sizes.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.benchmarks import model_cost, results, timing

#: The figures an A/B run compares: (key of `results.figures`, label).
FIGURES: tuple[tuple[str, str], ...] = (
    ("prefill_tokens_per_s_per_device", "prefill throughput (tokens/s/device)"),
    ("decode_avg_sps", "decode avg_SPS (steps/s)"),
    ("decode_accepted_tokens_per_s_per_device", "decode throughput, accepted tokens (tokens/s/device)"),
)
WORK_LABEL = "decode throughput x active parameters per token (G parameter-tokens/s)"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RunFailed(RuntimeError):
    """A benchmark process failed; the message has its command, exit status and the end of its stderr."""


@dataclass(frozen=True)
class Side:
    name: str
    env: dict[str, str] = field(default_factory=dict)  # set over the environment as it is
    model: str | None = None  # replaces --model_name (None: as given)

    def describe(self) -> str:
        changes = [f"{k}={v}" for k, v in self.env.items()] + ([f"--model_name {self.model}"] if self.model else [])
        return " ".join(changes) if changes else "as given"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The A/B options (on the benchmark's parser, and alone on `split_argv`'s)."""
    parser.add_argument("--ab", action="append", default=[], metavar="NAME=VALUE",
                        help="A/B mode: also run the benchmark with this environment variable set (repeat for "
                             "several) and compare; each side and round is a fresh process, the order alternating")
    parser.add_argument("--ab_model", default=None, metavar="DIR",
                        help="A/B mode: side B runs this checkpoint instead of --model_name")
    parser.add_argument("--ab_rounds", type=int, default=3, help="A/B mode: rounds (one run of each side per round)")


def split_argv(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the A/B options, the rest of `argv`): the rest is the command line each side's process runs."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return parser.parse_known_args(list(argv))


def parse_assignments(items: Sequence[str]) -> dict[str, str]:
    """`NAME=VALUE` items as a dict; ValueError naming a malformed one."""
    env: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _NAME.match(name):
            raise ValueError(f"--ab {item!r}: give an environment variable as NAME=VALUE, e.g. "
                             f"--ab DEEPINFER_CPU_HUGE_PAGES=0")
        env[name] = value
    return env


def sides_of(options: argparse.Namespace) -> list[Side]:
    """Side A (the command as given) and side B (the changes `--ab` / `--ab_model` ask for)."""
    env = parse_assignments(options.ab)
    if not env and options.ab_model is None:
        raise ValueError("an A/B run needs side B's changes: --ab NAME=VALUE and/or --ab_model DIR")
    if options.ab_rounds < 1:
        raise ValueError(f"--ab_rounds {options.ab_rounds} must be >= 1")
    return [Side("A"), Side("B", env, options.ab_model)]


def run_recorded(command: Sequence[str], env: Mapping[str, str]) -> dict[str, Any]:
    """Run a benchmark command with `--result_jsonl` pointing at a file of its own (it replaces any
    earlier one on the command line) and return the record it appended."""
    with tempfile.TemporaryDirectory(prefix="deepinfer-ab-") as tmp:
        out = Path(tmp) / "result.jsonl"
        cmd = [*command, "--result_jsonl", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(env))
        if done.returncode != 0 or not out.is_file():
            raise RunFailed(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        return results.read_jsonl(out)[-1]


def run_sides(command: Sequence[str], sides: Sequence[Side], rounds: int, env: Mapping[str, str] | None = None,
              run: Callable[[Sequence[str], Mapping[str, str]], dict[str, Any]] = run_recorded,
              on_record: Callable[[int, str, dict[str, Any]], None] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Each side's records, one per round (`command` is side A's; `run` runs one process)."""
    base = dict(os.environ if env is None else env)

    def measure(side: Side) -> Callable[[Any], dict[str, Any]]:
        cmd = [*command, *(["--model_name", side.model] if side.model else [])]
        return lambda _case: run(cmd, {**base, **side.env})

    samples = timing.alternating_rounds({side.name: measure(side) for side in sides}, rounds,
                                        on_sample=None if on_record is None else
                                        lambda r, _case, name, record: on_record(r, name, record))
    return samples[None]


def active_params_if_models_differ(records: Mapping[str, list[dict[str, Any]]]) -> dict[str, int | None] | None:
    """Side -> active parameters per decode token of the checkpoint it ran, when the sides ran
    different checkpoints (None when they ran the same one); None for a side whose family the cost
    model does not count."""
    paths = {side: runs[0]["model"]["path"] for side, runs in records.items() if runs}
    if len(set(paths.values())) < 2:
        return None
    params: dict[str, int | None] = {}
    for side, path in paths.items():
        config, _, _ = model_cost.checkpoint_config(path)
        try:
            params[side] = model_cost.token_cost(config).active_params
        except ValueError:
            params[side] = None
    return params


@dataclass(frozen=True)
class Row:
    label: str
    a: float  # median over the rounds
    b: float
    ratio: timing.Spread  # per-round B / A


def summarise(records: Mapping[str, list[dict[str, Any]]], active_params: Mapping[str, int | None] | None = None,
              a: str = "A", b: str = "B") -> list[Row]:
    """One row per figure both sides measured in every round; with `active_params` (side -> active
    parameters per token) also decode throughput times them."""
    figures = {side: [results.figures(r) for r in runs] for side, runs in records.items()}
    rows = []
    for key, label in FIGURES:
        values = {side: [f[key]["median"] if f[key] else None for f in figures[side]] for side in (a, b)}
        if any(v is None for side in (a, b) for v in values[side]):
            continue
        rows.append(_row(label, values[a], values[b]))
        if key == "decode_accepted_tokens_per_s_per_device" and active_params and all(
                active_params.get(side) for side in (a, b)):
            rows.append(_row(WORK_LABEL, [v * active_params[a] / 1e9 for v in values[a]],
                             [v * active_params[b] / 1e9 for v in values[b]]))
    return rows


def _row(label: str, a: list[float], b: list[float]) -> Row:
    return Row(label, statistics.median(a), statistics.median(b), timing.Spread.of(timing.ratios(b, a)))


def format_summary(rows: Sequence[Row], sides: Sequence[Side], rounds: int) -> str:
    a, b = sides
    lines = [f"A/B over {rounds} round(s), one process per side and round, the order alternating; "
             f"A: {a.describe()}; B: {b.describe()}", "",
             "| figure | A | B | B / A (median of rounds; min-max) |", "|---|---:|---:|---:|"]
    lines += [f"| {r.label} | {r.a:,.2f} | {r.b:,.2f} | {r.ratio.text()} |" for r in rows]
    if not rows:
        lines.append("| (no figure measured by both sides in every round) | | | |")
    return "\n".join(lines)
