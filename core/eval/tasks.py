"""Benchmark tasks and the files they are read from.

AIME 2024/2025/2026 come from the `sgl-eval` package (installed with `--no-deps`; its problems are
read where the package keeps them, never copied here). GPQA Diamond and HLE are gated data sets:
the user supplies the official files (GPQA's `gpqa_diamond.csv`, HLE's test split as JSONL) and a
missing or malformed file is a `DataError` that names the file expected and how to get it.
"""
from __future__ import annotations

import csv
import json
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

AnswerType = Literal["integer", "choice", "letter", "exact"]

SGL_EVAL_INSTALL = "pip install --no-deps 'sgl-eval==0.1.3'"
# where sgl-eval 0.1.3 keeps the AIME problems (NeMo-Skills-shaped JSONL: id, problem, expected_answer)
_SGL_EVAL_AIME = "_vendored/nemo_skills/dataset/aime{yy}/test.txt"
AIME_YEARS = (2024, 2025, 2026)

GPQA_COLUMNS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
GPQA_HELP = ("GPQA Diamond is gated: accept its terms at https://huggingface.co/datasets/Idavidrein/gpqa, download "
             "gpqa_diamond.csv (the official CSV, columns " + ", ".join(repr(c) for c in GPQA_COLUMNS) + ") and pass "
             "--data /path/to/gpqa_diamond.csv")
HLE_HELP = ("HLE is gated: accept its terms at https://huggingface.co/datasets/cais/hle, write the test split as JSONL "
            "(python -c \"import datasets; datasets.load_dataset('cais/hle', split='test').to_json('hle.jsonl')\") and "
            "pass --data /path/to/hle.jsonl (one object a line with id, question, answer, answer_type, image)")


class DataError(ValueError):
    """A benchmark's data cannot be read; the message names the file expected and the fix."""


class Task(BaseModel):
    """One question. `answer_type` says how it is scored: "integer" (AIME: the last boxed integer
    0-999), "choice" (GPQA: `choices` holds the correct answer first, then the incorrect ones, in
    the file's order; each sample shows them in its own seeded order), "letter" (HLE multiple
    choice: the question lists its options, `answer` is the letter) or "exact" (HLE short answer:
    judged by an LLM). `image` (HLE): the image the question refers to, as the file gives it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    question: str
    answer: str
    answer_type: AnswerType
    choices: tuple[str, ...] = ()
    image: str | None = None
    subject: str | None = None


def aime_tasks(year: int) -> list[Task]:
    """The 30 problems of AIME `year` from the installed sgl-eval package."""
    if year not in AIME_YEARS:
        raise DataError(f"no AIME {year} problems: sgl-eval carries {', '.join(map(str, AIME_YEARS))}")
    try:
        root = resources.files("sgl_eval")
    except ModuleNotFoundError:
        raise DataError(f"the AIME problems come from the sgl-eval package, which is not installed; install it "
                        f"with `{SGL_EVAL_INSTALL}` (scripts/setup_env.sh does)") from None
    source = root / _SGL_EVAL_AIME.format(yy=year % 100)
    if not source.is_file():
        raise DataError(f"the installed sgl-eval has no {_SGL_EVAL_AIME.format(yy=year % 100)}; install the "
                        f"version deepinfer reads with `{SGL_EVAL_INSTALL}`")
    tasks = []
    for line in source.read_text(encoding="utf-8").splitlines():
        if line.strip():
            item = json.loads(line)
            tasks.append(Task(id=str(item["id"]), question=item["problem"], answer=str(item["expected_answer"]),
                              answer_type="integer"))
    return tasks


def _require_file(path: str | Path | None, what: str, help_text: str) -> Path:
    if path is None:
        raise DataError(f"{what} needs its data file. {help_text}")
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{what}: no file at {p}. {help_text}")
    return p


def gpqa_tasks(path: str | Path | None) -> list[Task]:
    """GPQA from its official CSV (`gpqa_diamond.csv`: 198 questions)."""
    p = _require_file(path, "GPQA Diamond", GPQA_HELP)
    with p.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in GPQA_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise DataError(f"{p} is not GPQA's CSV: it lacks the columns {missing}. {GPQA_HELP}")
        rows = list(reader)
    tasks = []
    for n, row in enumerate(rows):
        choices = tuple(_clean(row[c]) for c in GPQA_COLUMNS[1:])
        if not all(choices):
            raise DataError(f"{p} row {n + 2}: an answer column is empty; the file is not the official CSV")
        tasks.append(Task(id=row.get("Record ID") or f"gpqa-{n}", question=_clean(row["Question"]),
                          answer=choices[0], answer_type="choice", choices=choices,
                          subject=row.get("Subdomain") or row.get("High-level domain") or None))
    return tasks


def _clean(text: str | None) -> str:
    """GPQA's text as the common harnesses present it (lm-eval's preprocessing): stripped, the
    scraped ' [title]' markers turned into sentence breaks, double spaces single."""
    return (text or "").strip().replace(" [title]", ". ").replace("  ", " ")


class _HleItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    question: str
    answer: str
    answer_type: Literal["exactMatch", "multipleChoice"]
    image: str | None = None
    category: str | None = None


def hle_tasks(path: str | Path | None) -> list[Task]:
    """HLE from its test split as JSONL (2,500 questions, 342 of them with an image)."""
    p = _require_file(path, "HLE", HLE_HELP)
    tasks = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = _HleItem.model_validate_json(line)
            except ValidationError as e:
                problems = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
                raise DataError(f"{p} line {n} is not an HLE row ({problems}). {HLE_HELP}") from None
            tasks.append(Task(id=item.id, question=item.question, answer=item.answer.strip(),
                              answer_type="letter" if item.answer_type == "multipleChoice" else "exact",
                              image=item.image or None, subject=item.category))
    return tasks
