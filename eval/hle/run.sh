#!/usr/bin/env bash
# Humanity's Last Exam (2,500 questions; those with an image are skipped and counted until deepinfer has vision input).
#   JUDGE_ENDPOINT=https://.../v1 JUDGE_MODEL=NAME bash eval/hle/run.sh --data /path/to/hle.jsonl [--model DIR | ...]
# Multiple-choice answers are matched by letter; short answers need the LLM judge (any OpenAI-compatible server).
# The data set is gated: write its test split as JSONL yourself (docs/eval.md says how).
exec bash "$(dirname "$0")/../run_benchmark.sh" hle "$@"
