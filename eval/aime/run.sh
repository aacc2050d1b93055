#!/usr/bin/env bash
# AIME 2026 (30 problems x 32 samples; AIME=aime24 or aime25 for the other years), Pass@1 of the last \boxed{} integer.
#   bash eval/aime/run.sh [--model DIR | --endpoint URL] [--samples N] [--ep N --dp N --cp N] [...]
# The problems come from the sgl-eval package (scripts/setup_env.sh installs it). See docs/eval.md.
exec bash "$(dirname "$0")/../run_benchmark.sh" "${AIME:-aime26}" "$@"
