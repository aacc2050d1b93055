#!/usr/bin/env bash
# The three stages of `deepinfer eval` for one benchmark (docs/eval.md); eval/<name>/run.sh call it.
#
#   bash eval/run_benchmark.sh BENCHMARK [flags of `deepinfer eval generate`...]
#
# Environment: OUT (default eval_results/BENCHMARK: generations.jsonl, scores.jsonl, scores_report.json/.png),
# JUDGE_ENDPOINT / JUDGE_MODEL (an LLM judge for the score stage), DEEPINFER (the command; default: the
# repository's .venv/bin/deepinfer if there is one, else `deepinfer` on PATH).
# Generation resumes: run the same command again after an interruption and only the missing samples are made.
set -euo pipefail
bench=${1:?usage: run_benchmark.sh BENCHMARK [generate flags]}
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "${DEEPINFER:-}" ]; then
    if [ -x "$root/.venv/bin/deepinfer" ]; then DEEPINFER="$root/.venv/bin/deepinfer"; else DEEPINFER=deepinfer; fi
fi
out=${OUT:-eval_results/$bench}
judge=()
if [ -n "${JUDGE_ENDPOINT:-}" ]; then judge+=(--judge-endpoint "$JUDGE_ENDPOINT"); fi
if [ -n "${JUDGE_MODEL:-}" ]; then judge+=(--judge-model "$JUDGE_MODEL"); fi

"$DEEPINFER" eval generate "$bench" --output "$out/generations.jsonl" "$@"
"$DEEPINFER" eval score "$out/generations.jsonl" --output "$out/scores.jsonl" ${judge[@]+"${judge[@]}"}
"$DEEPINFER" eval report "$out/scores.jsonl"
