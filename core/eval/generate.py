"""The generate stage: every (task, sample) of a benchmark not yet in the generation file, through
the offline engine (any `--ep/--dp/--cp` layout, one process per rank) or an endpoint, appended
row by row (`rows.py`) with a progress bar that shows the tokens per second.

A sample's key is (task id, sample index, run seed). Its sampling seed is derived from the three
(`sampling_seed`), so a resumed or re-run sample draws the same tokens where the engine is
deterministic, and two runs with different run seeds draw different ones.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from deepinfer.eval import benchmarks as bm
from deepinfer.eval.backends import Completion, SamplingSettings, chat_body
from deepinfer.eval.rows import GenerationFileError, Key, Row, RowWriter, fingerprint, read_rows, repair_tail
from deepinfer.eval.tasks import Task

#: why a task is not run (and its rows say "skipped"): the engine has no image input yet
IMAGE_SKIP = "the task has an image and deepinfer has no vision input yet"


@dataclass(frozen=True)
class Job:
    """One sample to generate."""

    task: Task
    sample: int
    seed: int
    messages: list[dict[str, Any]]
    choice_order: list[int] | None

    @property
    def key(self) -> Key:
        return (self.task.id, self.sample, self.seed)

    @property
    def request_id(self) -> str:
        return f"{self.task.id}#{self.sample}#{self.seed}"

    @property
    def sampling_seed(self) -> int:
        digest = hashlib.sha256(f"{self.task.id}:{self.sample}:{self.seed}".encode()).digest()
        return int.from_bytes(digest[:7], "big")  # < 2^56: inside every engine's seed range


def plan(tasks: list[Task], samples: int, seed: int, done: set[Key] = frozenset()) -> list[Job]:
    """The samples still to generate, task by task."""
    if samples < 1:
        raise ValueError(f"--samples {samples} must be >= 1")
    jobs = []
    for task in tasks:
        for sample in range(samples):
            if (task.id, sample, seed) in done:
                continue
            order = bm.choice_order(task.id, sample, seed, len(task.choices)) if task.answer_type == "choice" else None
            jobs.append(Job(task, sample, seed, bm.messages(task, order), order))
    return jobs


def prompt_templates() -> str:
    """A hash of every prompt template: part of a run's fingerprint (a changed prompt is another run)."""
    return fingerprint({"aime": bm.AIME_PROMPT, "gpqa": bm.GPQA_PROMPT, "hle": [bm.HLE_SYSTEM_CHOICE,
                                                                                bm.HLE_SYSTEM_EXACT]})


@dataclass
class Run:
    """What a generate run needs besides the back end: where rows go, the benchmark, the settings,
    and the fingerprints of the rows the file held when the run started."""

    output: Path
    benchmark: str
    settings: SamplingSettings
    existing: dict[str, dict[str, Any]]  # fingerprint -> engine description, of the rows already written
    progress: bool = True

    def engine_description(self, backend: dict[str, Any]) -> dict[str, Any]:
        from deepinfer.version import __version__

        return {**backend, "deepinfer": __version__, "benchmark": self.benchmark,
                "sampling": self.settings.model_dump(mode="json"), "prompts": prompt_templates()}

    def check_resumable(self, engine: dict[str, Any]) -> str:
        """This run's fingerprint; GenerationFileError if the file holds rows of another configuration
        (results of two configurations would be averaged together)."""
        mine = fingerprint(engine)
        other = next((e for fp, e in self.existing.items() if fp != mine), None)
        if other is not None:
            differ = sorted(k for k in engine.keys() | other.keys() if engine.get(k) != other.get(k))
            detail = "; ".join(f"{k}: {other.get(k)!r} there, {engine.get(k)!r} now" for k in differ)
            raise GenerationFileError(
                f"{self.output} holds rows made by another engine or with other settings ({detail}); resuming would "
                f"mix two configurations. Write to a new --output file, or delete this one")
        return mine


def open_run(output: str | Path, benchmark: str, settings: SamplingSettings, progress: bool = True
             ) -> tuple[Run, set[Key]]:
    """The run over `output` and the keys it holds already; a last line cut off by an interrupted
    write is dropped first (with a note)."""
    path = Path(output)
    if repair_tail(path):
        print(f"note: dropped the cut-off last line of {path} (an interrupted write); that sample is generated "
              f"again", flush=True)
    rows = read_rows(path) if path.is_file() else []
    existing = {r.fingerprint: r.engine for r in rows}
    return Run(path, benchmark, settings, existing, progress), {r.key for r in rows if r.done}


def make_row(run: Run, job: Job, completion: Completion, fp: str, engine: dict[str, Any],
             layout: str | None = None) -> Row:
    return Row(benchmark=run.benchmark, task_id=job.task.id, sample=job.sample, seed=job.seed,
               sampling_seed=job.sampling_seed, messages=job.messages, text=completion.text,
               reasoning=completion.reasoning,
               finish_reason=completion.finish_reason if completion.error is None else "error",
               prompt_tokens=completion.prompt_tokens, completion_tokens=completion.completion_tokens,
               answer_type=job.task.answer_type, expected=job.task.answer, choice_order=job.choice_order,
               error=completion.error, fingerprint=fp, engine=engine, layout=layout)


def skipped_row(run: Run, job: Job, reason: str, fp: str, engine: dict[str, Any], layout: str | None) -> Row:
    return make_row(run, job, Completion(finish_reason="skipped"), fp, engine, layout).model_copy(
        update={"finish_reason": "skipped", "error": reason})


@dataclass
class Stats:
    written: int = 0
    failed: int = 0
    skipped: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def merge(self, other: Stats) -> Stats:
        return Stats(self.written + other.written, self.failed + other.failed, self.skipped + other.skipped,
                     self.completion_tokens + other.completion_tokens, max(self.seconds, other.seconds))


def generate(run: Run, backend: Any, description: dict[str, Any], jobs: list[Job], write: bool = True,
             progress: bool | None = None, layout: str | None = None) -> Stats:
    """Run `jobs` through `backend` (an `OfflineBackend` or `EndpointBackend`) and append a row for
    each as it finishes (`write` False: a context-parallel peer, which serves the same requests as
    the rank that writes; `layout`: the offline engine's, recorded in each row). Image tasks are
    written as skipped rows without running."""
    engine = run.engine_description(description)
    fp = run.check_resumable(engine)
    writer = RowWriter(run.output)
    stats = Stats()
    runnable = []
    for job in jobs:
        if job.task.image is not None:
            if write:
                writer.append(skipped_row(run, job, IMAGE_SKIP, fp, engine, layout))
            stats.skipped += 1
        else:
            runnable.append(job)
    by_id = {job.request_id: job for job in runnable}
    bodies = ((job.request_id, chat_body(backend.model, job.messages, job.sampling_seed, run.settings))
              for job in runnable)
    start = time.perf_counter()
    for job, completion in _progress(((by_id[rid], c) for rid, c in backend.run(bodies)), len(runnable),
                                     run.progress if progress is None else progress, start, stats):
        if write:
            writer.append(make_row(run, job, completion, fp, engine, layout))
        stats.written += 1
        stats.failed += completion.error is not None
        stats.completion_tokens += completion.completion_tokens
    stats.seconds = time.perf_counter() - start
    return stats


def _progress(items: Iterable[tuple[Job, Completion]], total: int, enabled: bool, start: float,
              stats: Stats) -> Iterator[tuple[Job, Completion]]:
    if not enabled or total == 0:
        yield from items
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, desc="samples", unit="sample", dynamic_ncols=True) as bar:
        for item in items:
            yield item
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{stats.completion_tokens / elapsed:.1f} tok/s, {stats.failed} failed", refresh=False)
            bar.update(1)
