"""`deepinfer eval`: offline Pass@1 evaluation (AIME, GPQA Diamond, HLE) in three stages.

- `generate` (`generate.py`): the tasks through the offline engine or any OpenAI-compatible
  endpoint, one JSONL row per (task, sample, seed), resumable;
- `score` (`scoring.py`, `judge.py`): pure, no model — answer extraction and exact match, an LLM
  judge through an endpoint where the benchmark needs one; re-scoring never regenerates;
- `report` (`report.py`): pass@1 with its standard error, pass@k, majority@k, no-answer rate,
  the per-task table, a JSON summary and a plot.

The benchmarks (`benchmarks.py`) say where their data comes from (`tasks.py`) and how their
prompts read. See docs/eval.md.
"""
