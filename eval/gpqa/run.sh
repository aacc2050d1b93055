#!/usr/bin/env bash
# GPQA Diamond (198 questions x 8 samples), Pass@1 of the last "Answer: X" through each sample's choice order.
#   bash eval/gpqa/run.sh --data /path/to/gpqa_diamond.csv [--model DIR | --endpoint URL] [...]
# The data set is gated: download the official CSV yourself (docs/eval.md says where).
exec bash "$(dirname "$0")/../run_benchmark.sh" gpqa "$@"
