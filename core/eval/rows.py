"""The generation file: one JSONL row per (task, sample, seed), appended as each finishes.

Rows are appended under an exclusive lock (`fcntl.flock`), one `write` per row, so the ranks of a
data-parallel run can share one file. A run that stops (Ctrl-C, a crash, a lost node) leaves every
finished row in place; the next run with the same arguments generates only the keys not yet
written. A last line cut off mid-write is dropped when the file is opened for resuming. A row that
failed does not count as done: the next run tries it again, and a later row for the same key
replaces it when the file is read. A skipped row (an image task) counts as done: this deepinfer
cannot run it, and one that can is another version, so another fingerprint and another file. Rows of another engine or other
settings are refused (`generate.Run.check_resumable`).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from deepinfer.eval.tasks import AnswerType

Key = tuple[str, int, int]  # (task id, sample index, seed)


class Row(BaseModel):
    """One generated sample: the prompt, the answer (`text`) and the reasoning apart, how it ended,
    token counts, and what the scorer needs without the data files (`expected`, `answer_type`,
    `choice_order` for GPQA). `fingerprint` identifies the engine and settings (`engine`) that made it."""

    model_config = ConfigDict(extra="forbid")

    benchmark: str
    task_id: str
    sample: int
    seed: int
    sampling_seed: int
    messages: list[dict[str, Any]]
    text: str = ""
    reasoning: str | None = None
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    answer_type: AnswerType
    expected: str
    choice_order: list[int] | None = None
    error: str | None = None
    fingerprint: str
    engine: dict[str, Any]
    layout: str | None = None  # the offline engine's parallel layout (not fingerprinted: a run may resume on another)

    @property
    def key(self) -> Key:
        return (self.task_id, self.sample, self.seed)

    @property
    def done(self) -> bool:
        """Whether a resumed run leaves this key alone (module docstring)."""
        return self.error is None or self.finish_reason == "skipped"

    @property
    def question(self) -> str:
        """The user message of the prompt (what a judge is shown)."""
        return next((m["content"] for m in reversed(self.messages) if m.get("role") == "user"), "")


def fingerprint(engine: dict[str, Any]) -> str:
    """A short hash of the engine and settings description (canonical JSON)."""
    return hashlib.sha256(json.dumps(engine, sort_keys=True, default=str).encode()).hexdigest()[:16]


class GenerationFileError(ValueError):
    """The generation file cannot be resumed as asked; the message says why and what to do."""


def read_rows(path: str | Path) -> list[Row]:
    """Every row of a generation file, the last row of each key only, in file order. A line that is
    not a row is an error naming the line (a cut-off last line is left to `repair_tail`)."""
    latest: dict[Key, Row] = {}
    p = Path(path)
    if not p.is_file():
        raise GenerationFileError(f"no generation file at {p}; run `deepinfer eval generate --output {p}` first")
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = Row.model_validate_json(line)
            except ValidationError as e:
                where = ("the last line is cut off by an interrupted write; run `deepinfer eval generate` with the "
                         "same arguments, which drops it and makes that sample again") if not line.endswith("\n") \
                    else str(e)
                raise GenerationFileError(f"{p} line {n} is not a generation row: {where}") from None
            latest.pop(row.key, None)  # a later row of a key replaces the earlier one, and takes its place
            latest[row.key] = row
    return list(latest.values())


def repair_tail(path: Path) -> bool:
    """Drop a last line cut off mid-write (no newline at the end); True if one was dropped."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with path.open("rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return False
        data = f.seek(0) or f.read()
        f.truncate(data.rfind(b"\n") + 1)
    return True


class RowWriter:
    """Appends rows to the generation file; safe across processes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, row: Row) -> None:
        line = (row.model_dump_json() + "\n").encode("utf-8")
        with self.path.open("ab") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                f.write(line)
                f.flush()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
