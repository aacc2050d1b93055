#!/usr/bin/env bash
# Sweep the benchmark and plot a throughput Pareto chart.
#
#   bash examples/sweep/run_sweep.sh decode  TAG CONTEXT [VALUES] [benchmark.py flags...]
#   bash examples/sweep/run_sweep.sh prefill TAG CONTEXT [VALUES] [benchmark.py flags...]
#
# decode:  one run per --decode_num_requests in VALUES (default 1,2,4,8,16,32,64), each decoding
#          at --context_length CONTEXT; plots throughput against per-user speed.
# prefill: one run per --prefill_batch_size in VALUES (default 4096,8192,16384,32768,65536), each
#          prefilling prompts of CONTEXT tokens (--non_cached_tokens CONTEXT); plots throughput
#          against the latency of one prefill step.
# Results: sweeps/TAG/results.jsonl (appended) and sweeps/TAG/<mode>_pareto.png. The parallel
# scale is not visible in the command: put it in TAG (e.g. cpu1-decode-4k). Extra flags go to
# every run, e.g.  --preset cpu --model_name /tmp/v4-bench --repeats 3
# PYTHON selects the interpreter (default: python3); SWEEP_DIR the output root (default: sweeps).
set -euo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 3 ] || usage
MODE=$1; TAG=$2; CONTEXT=$3; shift 3
case "$MODE" in decode|prefill) ;; *) echo "error: mode must be decode or prefill, got '$MODE'" >&2; usage ;; esac
[[ "$CONTEXT" =~ ^[0-9]+$ ]] || { echo "error: CONTEXT must be a token count, got '$CONTEXT'" >&2; exit 2; }
[[ "$TAG" =~ ^[A-Za-z0-9._-]+$ ]] || { echo "error: TAG may hold only letters, digits, '.', '_' and '-', got '$TAG'" >&2; exit 2; }

if [ $# -ge 1 ] && [[ "$1" =~ ^[0-9]+(,[0-9]+)*$ ]]; then VALUES=$1; shift; \
elif [ "$MODE" = decode ]; then VALUES=1,2,4,8,16,32,64; else VALUES=4096,8192,16384,32768,65536; fi

HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
OUT=${SWEEP_DIR:-sweeps}/$TAG
mkdir -p "$OUT"
RESULTS=$OUT/results.jsonl

IFS=, read -ra POINTS <<< "$VALUES"
for v in "${POINTS[@]}"; do
  if [ "$MODE" = decode ]; then
    echo "== $TAG: decode, $v requests at context $CONTEXT"
    "$PY" "$HERE/../benchmark.py" --phase decode --context_length "$CONTEXT" --decode_num_requests "$v" \
        --tag "$TAG" --result_jsonl "$RESULTS" "$@"
  else
    echo "== $TAG: prefill, $v tokens per step, $CONTEXT-token prompts"
    "$PY" "$HERE/../benchmark.py" --phase prefill --non_cached_tokens "$CONTEXT" --prefill_batch_size "$v" \
        --tag "$TAG" --result_jsonl "$RESULTS" "$@"
  fi
done
"$PY" "$HERE/plot_pareto.py" "$MODE" "$RESULTS" "$OUT/${MODE}_pareto.png"
