"""The benchmarks: their data, default sample counts, and the chat messages of one sample.

Prompts follow the public harnesses' conventions so that the answers can be extracted the same
way: AIME asks for the final answer in `\\boxed{}` as an integer 0-999; GPQA shows the four options
in a seeded order of each sample and asks for a last line `Answer: X`; HLE asks, in a system
message, for an explanation, the answer on an `Answer:` (multiple choice) or `Exact Answer:` line,
and a confidence.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from deepinfer.eval.tasks import AIME_YEARS, Task, aime_tasks, gpqa_tasks, hle_tasks

AIME_PROMPT = ("Solve the following problem. Reason step by step, and put your final answer within \\boxed{{}}. "
               "The answer is an integer between 0 and 999 inclusive.\n\n{question}")
GPQA_PROMPT = ("Answer the following multiple choice question. Think step by step before answering. The last line "
               "of your response must be of the form 'Answer: X' (without quotes), where X is one of {letters}.\n\n"
               "{question}\n\n{options}")
HLE_SYSTEM_CHOICE = ("Your response must follow this format:\nExplanation: {your reasoning for the choice you make}\n"
                     "Answer: {the letter of the choice you make}\n"
                     "Confidence: {how confident you are in the answer, from 0% to 100%}")
HLE_SYSTEM_EXACT = ("Your response must follow this format:\nExplanation: {your reasoning for your final answer}\n"
                    "Exact Answer: {your final answer, as short as possible}\n"
                    "Confidence: {how confident you are in the answer, from 0% to 100%}")


@dataclass(frozen=True)
class Benchmark:
    """`load(data)`: the tasks (`data` is the file a gated benchmark reads, else unused);
    `samples`: the default samples per task (the seeds': AIME 32, GPQA 8, HLE 1)."""

    name: str
    description: str
    samples: int
    load: Callable[[str | Path | None], list[Task]]
    needs_data: bool = False


BENCHMARKS: dict[str, Benchmark] = {
    **{f"aime{y % 100}": Benchmark(f"aime{y % 100}", f"AIME {y} (30 problems, from sgl-eval)", 32,
                                   lambda _data, y=y: aime_tasks(y)) for y in AIME_YEARS},
    "gpqa": Benchmark("gpqa", "GPQA Diamond (198 questions, the official CSV via --data)", 8, gpqa_tasks,
                      needs_data=True),
    "hle": Benchmark("hle", "Humanity's Last Exam (2,500 questions, the test split as JSONL via --data)", 1,
                     hle_tasks, needs_data=True),
}


def find_benchmark(name: str) -> Benchmark:
    try:
        return BENCHMARKS[name]
    except KeyError:
        raise ValueError(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}") from None


def choice_order(task_id: str, sample: int, seed: int, n: int) -> list[int]:
    """The order sample `sample` (run seed `seed`) shows the choices of task `task_id` in: entry i is
    the index in `Task.choices` shown as letter i. Seeded by the three, so it is the same on every
    machine and every resumed run (random.Random hashes a string seed with SHA-512)."""
    order = list(range(n))
    random.Random(f"{task_id}:{sample}:{seed}").shuffle(order)
    return order


def messages(task: Task, order: list[int] | None = None) -> list[dict]:
    """The chat messages of one sample (`order`: the choice order of a "choice" task)."""
    if task.answer_type == "integer":
        return [{"role": "user", "content": AIME_PROMPT.format(question=task.question)}]
    if task.answer_type == "choice":
        if order is None or sorted(order) != list(range(len(task.choices))):
            raise ValueError(f"task {task.id}: a choice order over its {len(task.choices)} choices is needed")
        letters = string.ascii_uppercase[:len(order)]
        options = "\n".join(f"{letter}) {task.choices[i]}" for letter, i in zip(letters, order))
        return [{"role": "user", "content": GPQA_PROMPT.format(question=task.question, options=options,
                                                                letters=", ".join(letters))}]
    system = HLE_SYSTEM_CHOICE if task.answer_type == "letter" else HLE_SYSTEM_EXACT
    return [{"role": "system", "content": system}, {"role": "user", "content": task.question}]
