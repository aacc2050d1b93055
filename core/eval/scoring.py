"""The score stage: pure (no model) — the answer of each generated row, read from its text (the
part after the reasoning), compared with the expected one.

- "integer" (AIME): the content of the last `\\boxed{...}` (or `\\fbox{...}`) as an integer 0-999
  (leading zeros, `$`, `\\text{}`-style wrappers and a trailing `.0` allowed); anything else in it
  is no answer;
- "choice" (GPQA): the letter of the last `Answer: X` line (markdown emphasis and a `\\boxed{}`
  around the letter allowed), mapped back through the sample's choice order to the choice it
  shows; a letter outside the choices is no answer;
- "letter" (HLE multiple choice): the same letter, compared with HLE's answer letter;
- "exact" (HLE short answer): an LLM judge (`judge.py`) decides; without one these rows stay
  unscored ("unjudged").

Each score records how it was reached, so a re-score with another judge writes a new file next to
the old one and never touches the generations.
"""
from __future__ import annotations

import re
import string
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from deepinfer.eval.judge import Judge, JudgeError
from deepinfer.eval.rows import Row

Status = Literal["scored", "unjudged", "skipped", "error"]

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_WRAPPER = re.compile(r"^\\(?:text|textbf|mathbf|mathrm|mbox)\s*\{(.*)\}$", re.S)
_INTEGER = re.compile(r"0*(\d+)(?:\.0*)?")
_ANSWER_LETTER = re.compile(r"(?i)[*_]{0,2}answer[*_]{0,2}\s*:[\s*_$]*"
                            r"(?:\\(?:boxed|text|textbf|mathbf)\s*\{\s*)?\(?([a-z])\)?(?![a-z0-9])")
_EXACT_ANSWER = re.compile(r"(?im)^[*_]{0,2}exact answer[*_]{0,2}\s*:[*_]{0,2}\s*(.+?)\s*$")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `text` (braces balanced), None if there is none or
    it is not closed."""
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def aime_integer(content: str | None) -> int | None:
    """`content` (a box's content, or an expected answer) as an integer 0-999, else None."""
    if content is None:
        return None
    content = content.strip().strip("$").strip()
    while (m := _WRAPPER.match(content)) is not None:
        content = m.group(1).strip()
    m = _INTEGER.fullmatch(content)
    if m is None:
        return None
    value = int(m.group(1))
    return value if value <= 999 else None


def aime_answer(text: str) -> int | None:
    """The integer 0-999 in the last `\\boxed{}`; None for no box or anything else in it."""
    return aime_integer(last_boxed(text))


def answer_letter(text: str, n_choices: int) -> str | None:
    """The letter of the last `Answer: X` of `text`, if it names one of the first `n_choices` letters."""
    matches = _ANSWER_LETTER.findall(text)
    if not matches:
        return None
    letter = matches[-1].upper()
    return letter if letter in string.ascii_uppercase[:n_choices] else None


def exact_answer(text: str) -> str | None:
    """What the last `Exact Answer:` line of an HLE response says (shown to no one but the report)."""
    found = _EXACT_ANSWER.findall(text)
    return found[-1] if found else None


class Score(BaseModel):
    """One row's score: `answer` (None: no answer), `correct`, and `status`: "scored"; "unjudged"
    (needs a judge, or the judge failed: `note` says why); "skipped" (never run); "error" (the
    generation failed: counted as no answer)."""

    model_config = ConfigDict(extra="forbid")

    benchmark: str
    task_id: str
    sample: int
    seed: int
    answer_type: str
    expected: str
    answer: str | None
    correct: bool
    status: Status
    method: str
    finish_reason: str
    completion_tokens: int
    note: str | None = None
    judge: dict[str, Any] | None = None


def _score(row: Row, answer: str | None, correct: bool, method: str, status: Status = "scored",
           note: str | None = None, judge: dict[str, Any] | None = None) -> Score:
    return Score(benchmark=row.benchmark, task_id=row.task_id, sample=row.sample, seed=row.seed,
                 answer_type=row.answer_type, expected=row.expected, answer=answer, correct=correct, status=status,
                 method=method, finish_reason=row.finish_reason, completion_tokens=row.completion_tokens, note=note,
                 judge=judge)


def score_row(row: Row) -> Score:
    """The score of one row by its rules alone; an "exact" row is left unjudged."""
    if row.finish_reason == "skipped":
        return _score(row, None, False, "none", "skipped", row.error)
    if row.error is not None:
        return _score(row, None, False, "none", "error", row.error)
    if row.answer_type == "integer":
        value = aime_answer(row.text)
        return _score(row, None if value is None else str(value),
                      value is not None and value == aime_integer(row.expected), "boxed")
    if row.answer_type == "choice":
        order = row.choice_order or []
        letter = answer_letter(row.text, len(order))
        # the expected answer is choice 0 of the task; the sample showed choice order[i] as letter i
        shown = None if letter is None else order[ord(letter) - ord("A")]
        return _score(row, letter, shown == 0, "answer_letter")
    if row.answer_type == "letter":
        letter = answer_letter(row.text, 26)
        return _score(row, letter, letter is not None and letter == row.expected.strip().upper(), "answer_letter")
    return _score(row, exact_answer(row.text), False, "judge", "unjudged", "needs a judge (--judge-endpoint)")


def judge_row(row: Row, judge: Judge) -> Score:
    """An "exact" row scored by the judge; "unjudged" with the reason if the judge fails."""
    base = score_row(row)
    if base.status != "unjudged":
        return base
    description = judge.describe()
    if not row.text.strip():  # nothing to judge: no answer, as exact match would say
        return _score(row, None, False, "judge", judge=description)
    try:
        verdict = judge.judge(row.question, row.text, row.expected)
    except JudgeError as e:
        return _score(row, base.answer, False, "judge", "unjudged", str(e), judge=description)
    extracted = verdict.extracted_final_answer.strip()
    answer = None if extracted.lower() in ("", "none") else extracted
    return _score(row, answer, verdict.correct == "yes", "judge",
                  judge={**description, "reasoning": verdict.reasoning, "confidence": verdict.confidence})


def score_rows(rows: list[Row], judge: Judge | None = None, concurrency: int = 8) -> list[Score]:
    """Every row's score, in row order; the judge (if any) is asked `concurrency` rows at a time."""
    if judge is None:
        return [score_row(r) for r in rows]
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(lambda r: judge_row(r, judge), rows))
