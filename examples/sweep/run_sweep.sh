#!/usr/bin/env bash
# Sweep the benchmark and plot a throughput Pareto chart.
#
#   bash examples/sweep/run_sweep.sh decode  TAG CONTEXT [NEXTN [ACCEPT]] [--points LIST] [benchmark.py flags...]
#   bash examples/sweep/run_sweep.sh prefill TAG CONTEXT [--points LIST] [benchmark.py flags...]
#
# decode:  one run per --decode_num_requests in LIST (default 1,2,4,8,16,32,64), each decoding at
#          --context_length CONTEXT; plots throughput against per-user speed. NEXTN: the draft
#          length of every run (DEEPINFER_USE_NEXTN_DECODE; 0 turns speculation off). ACCEPT: the
#          share (0..1) of verified drafts assumed accepted: the chart then shows throughput and
#          per-user speed at that acceptance, avg_SPS x requests x (1 + ACCEPT x verified drafts per
#          step) / cp (benchmark.py --accept_rate; random-weight drafters accept almost nothing).
#          E.g. decode TAG 131072 3 0.75: 3 drafts, 3 x 0.75 accepted, 3.25 tokens per step.
# prefill: one run per --prefill_batch_size in LIST (default 4096,8192,16384,32768,65536), each
#          prefilling prompts of CONTEXT tokens (--non_cached_tokens CONTEXT); plots throughput
#          against the latency of one prefill step.
# Results: sweeps/TAG/results.jsonl (appended) and sweeps/TAG/<mode>_pareto.png. The parallel
# scale is not visible in the command: put it in TAG (e.g. cpu1-decode-4k). Extra flags go to
# every run, e.g.  --preset cpu --model_name /tmp/v4-bench --repeats 3
# PYTHON selects the interpreter (default: python3); SWEEP_DIR the output root (default: sweeps).
set -euo pipefail

usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
fail() { echo "error: $*" >&2; exit 2; }
[ $# -ge 3 ] || usage
MODE=$1; TAG=$2; CONTEXT=$3; shift 3
case "$MODE" in decode|prefill) ;; *) echo "error: mode must be decode or prefill, got '$MODE'" >&2; usage ;; esac
[[ "$CONTEXT" =~ ^[0-9]+$ ]] || fail "CONTEXT must be a token count, got '$CONTEXT'"
[[ "$TAG" =~ ^[A-Za-z0-9._-]+$ ]] || fail "TAG may hold only letters, digits, '.', '_' and '-', got '$TAG'"

NEXTN=""; ACCEPT=""
if [ "$MODE" = decode ] && [ $# -ge 1 ] && [[ "$1" != -* ]]; then
  [[ "$1" =~ ^[0-9]+$ ]] || fail "NEXTN (the draft length) must be a whole number, got '$1'$( \
    [[ "$1" == *,* ]] && echo "; a list of batch sizes goes in --points $1")"
  NEXTN=$1; shift
  if [ $# -ge 1 ] && [[ "$1" != -* ]]; then
    [[ "$1" =~ ^(0(\.[0-9]*)?|1(\.0*)?|\.[0-9]+)$ ]] || fail "ACCEPT must be a share between 0 and 1, got '$1'"
    ACCEPT=$1; shift
  fi
fi
[ $# -ge 1 ] && [[ "$1" != -* ]] && fail "unexpected argument '$1' (a list of points goes in --points LIST)"

if [ "$MODE" = decode ]; then POINTS_LIST=1,2,4,8,16,32,64; else POINTS_LIST=4096,8192,16384,32768,65536; fi
FLAGS=()
while [ $# -ge 1 ]; do
  if [ "$1" = --points ]; then
    [ $# -ge 2 ] || fail "--points needs a comma-separated list, e.g. --points 1,4,16"
    POINTS_LIST=$2; shift 2
  else
    FLAGS+=("$1"); shift
  fi
done
[[ "$POINTS_LIST" =~ ^[0-9]+(,[0-9]+)*$ ]] || fail "--points must be comma-separated whole numbers, got '$POINTS_LIST'"
[ -n "$ACCEPT" ] && FLAGS+=(--accept_rate "$ACCEPT")
[ -n "$NEXTN" ] && export DEEPINFER_USE_NEXTN_DECODE=$NEXTN

HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
OUT=${SWEEP_DIR:-sweeps}/$TAG
mkdir -p "$OUT"
RESULTS=$OUT/results.jsonl

IFS=, read -ra POINTS <<< "$POINTS_LIST"
for v in "${POINTS[@]}"; do
  if [ "$MODE" = decode ]; then
    echo "== $TAG: decode, $v requests at context $CONTEXT${NEXTN:+, nextn $NEXTN}${ACCEPT:+, accept_rate $ACCEPT}"
    "$PY" "$HERE/../benchmark.py" --phase decode --context_length "$CONTEXT" --decode_num_requests "$v" \
        --tag "$TAG" --result_jsonl "$RESULTS" ${FLAGS[@]+"${FLAGS[@]}"}
  else
    echo "== $TAG: prefill, $v tokens per step, $CONTEXT-token prompts"
    "$PY" "$HERE/../benchmark.py" --phase prefill --non_cached_tokens "$CONTEXT" --prefill_batch_size "$v" \
        --tag "$TAG" --result_jsonl "$RESULTS" ${FLAGS[@]+"${FLAGS[@]}"}
  fi
done
"$PY" "$HERE/plot_pareto.py" "$MODE" "$RESULTS" "$OUT/${MODE}_pareto.png"
