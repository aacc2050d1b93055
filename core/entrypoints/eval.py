"""`deepinfer eval`: offline benchmark evaluation in three stages (docs/eval.md).

    deepinfer eval generate aime26 --samples 32                       # the offline engine, default model
    deepinfer eval generate gpqa --data gpqa_diamond.csv --model /ckpt --ep 8
    deepinfer eval generate aime26 --endpoint http://127.0.0.1:8000/v1  # any OpenAI-compatible server
    deepinfer eval score eval_results/aime26/generations.jsonl
    deepinfer eval score eval_results/hle/generations.jsonl --judge-endpoint URL --judge-model NAME
    deepinfer eval report eval_results/aime26/scores.jsonl
    deepinfer eval list

generate appends one JSONL row per (task, sample, seed) and resumes where an interrupted run
stopped; score reads only that file (no model); report reads the scores.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path("eval_results")
API_KEY_VARIABLE = "OPENAI_API_KEY"  # the OpenAI clients' convention, for endpoints that need a key


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    from deepinfer.eval.benchmarks import BENCHMARKS

    parser = argparse.ArgumentParser(prog="deepinfer eval", description="Benchmark evaluation: generate, score, "
                                                                        "report (docs/eval.md).")
    sub = parser.add_subparsers(dest="stage", required=True)

    g = sub.add_parser("generate", help="generate the samples (offline engine or --endpoint); resumable")
    g.add_argument("benchmark", choices=list(BENCHMARKS))
    g.add_argument("--output", type=Path, default=None,
                   help="generation file (JSONL, appended; default eval_results/<benchmark>/generations.jsonl)")
    g.add_argument("--data", default=None, help="the data file of a gated benchmark (GPQA's CSV, HLE's JSONL)")
    g.add_argument("--samples", type=int, default=None, help="samples per task (default: the benchmark's: "
                   + ", ".join(f"{b.name} {b.samples}" for b in BENCHMARKS.values()) + ")")
    g.add_argument("--seed", type=int, default=0, help="run seed: with the task and sample index it seeds each "
                                                       "sample (default 0)")
    g.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    g.add_argument("--tasks", nargs="+", default=None, metavar="ID", help="only these task ids")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    s = g.add_argument_group("sampling (defaults: DeepSeek's published V4.1 settings, thinking on)")
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-p", type=float, default=0.95)
    s.add_argument("--max-tokens", type=int, default=None,
                   help="output tokens per sample (default: what the context leaves after the prompt)")
    s.add_argument("--no-thinking", action="store_true", help="thinking mode off")
    s.add_argument("--reasoning-effort", default="high", help="sent with thinking on (default high; 'none': not sent)")
    s.add_argument("--extra-body", type=_json_object, default={},
                   help="JSON object merged into every request body (e.g. another server's thinking switch)")
    e = g.add_argument_group("an OpenAI-compatible endpoint instead of the offline engine")
    e.add_argument("--endpoint", default=None, help="base URL, e.g. http://127.0.0.1:8000/v1")
    e.add_argument("--served-model", default=None, help="model name to send (default: the first the endpoint lists)")
    e.add_argument("--api-key", default=None, help=f"bearer key (default: ${API_KEY_VARIABLE} if set)")
    e.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    e.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request (default 3600)")
    o = g.add_argument_group("the offline engine (docs/configuration.md, docs/parallelism.md)")
    o.add_argument("--model", default=None, help="checkpoint directory or Hugging Face id in the local cache "
                                                 "(default: the default model, as for `deepinfer generate`)")
    o.add_argument("--config", default=None, help="TOML engine configuration (features under [features.<name>])")
    o.add_argument("--accelerator", default=None)
    o.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"])
    o.add_argument("--max-model-len", type=int, default=None)
    o.add_argument("--max-num-seqs", type=int, default=None)
    o.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1)")
    o.add_argument("--dp", type=int, default=None, help="data-parallel size (default ep // cp)")
    o.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    o.add_argument("--threads-per-rank", "--threads_per_rank", dest="threads_per_rank", type=int, default=None)

    sc = sub.add_parser("score", help="score a generation file (no model; a judge endpoint where needed)")
    sc.add_argument("generations", type=Path)
    sc.add_argument("--output", type=Path, default=None, help="score file (default: scores.jsonl beside the "
                                                              "generations; give another to keep a judge's apart)")
    j = sc.add_argument_group("an LLM judge (HLE's short answers)")
    j.add_argument("--judge-endpoint", default=None, help="base URL of an OpenAI-compatible server")
    j.add_argument("--judge-model", default=None, help="judge model name (default: the first the endpoint lists)")
    j.add_argument("--judge-api-key", default=None, help=f"bearer key (default: ${API_KEY_VARIABLE} if set)")
    j.add_argument("--judge-prompt", type=Path, default=None,
                   help="prompt file with {question}, {response} and {correct_answer} (default: deepinfer's)")
    j.add_argument("--judge-extra-body", type=_json_object, default={}, help="JSON merged into each judge request")
    j.add_argument("--judge-concurrency", type=int, default=8)

    r = sub.add_parser("report", help="metrics, per-task table, JSON summary and plot of a score file")
    r.add_argument("scores", type=Path)
    r.add_argument("--output", type=Path, default=None, help="JSON summary (default: <scores>_report.json)")
    r.add_argument("--no-plot", action="store_true", help="no per-task plot (<scores>_report.png)")

    sub.add_parser("list", help="the benchmarks and where their data comes from")
    return parser


def _offline_flags_given(args: argparse.Namespace) -> list[str]:
    """The flags configuring the offline engine that were given (a value other than the default)."""
    flags = [("--model", args.model, None), ("--config", args.config, None), ("--accelerator", args.accelerator, None),
             ("--dtype", args.dtype, None), ("--max-model-len", args.max_model_len, None),
             ("--max-num-seqs", args.max_num_seqs, None), ("--ep", args.ep, 1), ("--dp", args.dp, None),
             ("--cp", args.cp, 1), ("--threads-per-rank", args.threads_per_rank, None)]
    return [flag for flag, value, default in flags if value != default]


def _api_key(flag: str | None) -> str | None:
    return flag if flag is not None else (os.environ.get(API_KEY_VARIABLE) or None)


def cmd_generate(args: argparse.Namespace) -> int:
    from deepinfer.eval.backends import Endpoint, EndpointBackend, SamplingSettings
    from deepinfer.eval.benchmarks import find_benchmark
    from deepinfer.eval.generate import generate, open_run, plan
    from deepinfer.eval.offline import EngineSpec, run_offline

    bench = find_benchmark(args.benchmark)
    if args.endpoint:
        offline = _offline_flags_given(args)
        if offline:
            raise ValueError(f"{', '.join(offline)} configure the offline engine, which --endpoint replaces; "
                             f"leave them out (the server's own settings apply)")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit {args.limit} must be >= 1")
    settings = SamplingSettings(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                thinking=not args.no_thinking,
                                reasoning_effort=None if args.reasoning_effort == "none" else args.reasoning_effort,
                                extra_body=args.extra_body)
    tasks = bench.load(args.data)
    if args.tasks:
        unknown = sorted(set(args.tasks) - {t.id for t in tasks})
        if unknown:
            raise ValueError(f"{bench.name} has no tasks {unknown}")
        tasks = [t for t in tasks if t.id in set(args.tasks)]
    if args.limit is not None:
        tasks = tasks[:args.limit]
    output = args.output or DEFAULT_DIR / bench.name / "generations.jsonl"
    run, done = open_run(output, bench.name, settings, progress=not args.no_progress)
    jobs = plan(tasks, args.samples or bench.samples, args.seed, done)
    print(f"{bench.name}: {len(tasks)} tasks x {args.samples or bench.samples} samples; {len(done)} done in {output}, "
          f"{len(jobs)} to generate", flush=True)
    if not jobs:
        return 0
    if args.endpoint:
        endpoint = Endpoint(args.endpoint, _api_key(args.api_key), timeout=args.request_timeout)
        backend = EndpointBackend(endpoint, args.served_model or endpoint.default_model(), args.concurrency)
        stats = generate(run, backend, backend.describe(), jobs)
    else:
        spec = EngineSpec(model=args.model, config=args.config, accelerator=args.accelerator, dtype=args.dtype,
                          max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, ep=args.ep, dp=args.dp,
                          cp=args.cp, threads_per_rank=args.threads_per_rank)
        stats = run_offline(run, jobs, spec)
    rate = stats.completion_tokens / stats.seconds if stats.seconds else 0.0
    print(f"wrote {stats.written} samples ({stats.completion_tokens} output tokens, {rate:.1f} tok/s) in "
          f"{stats.seconds:.1f} s" + (f"; {stats.skipped} skipped (image tasks)" if stats.skipped else "")
          + f" -> {output}", flush=True)
    if stats.failed:
        print(f"error: {stats.failed} samples failed (their rows say why); run the same command again to retry them",
              file=sys.stderr)
        return 1
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from deepinfer.eval.backends import Endpoint
    from deepinfer.eval.judge import JUDGE_PROMPT, Judge
    from deepinfer.eval.rows import read_rows
    from deepinfer.eval.scoring import score_rows

    rows = read_rows(args.generations)
    judge = None
    if args.judge_endpoint:
        endpoint = Endpoint(args.judge_endpoint, _api_key(args.judge_api_key))
        prompt = args.judge_prompt.read_text(encoding="utf-8") if args.judge_prompt else JUDGE_PROMPT
        judge = Judge(endpoint, args.judge_model or endpoint.default_model(), prompt,
                      extra_body=args.judge_extra_body)
    scores = score_rows(rows, judge, args.judge_concurrency)
    output = args.output or args.generations.with_name("scores.jsonl")
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text("".join(s.model_dump_json() + "\n" for s in scores), encoding="utf-8")
    tmp.replace(output)
    by_status: dict[str, int] = {}
    for s in scores:
        by_status[s.status] = by_status.get(s.status, 0) + 1
    print(f"scored {len(scores)} rows ({', '.join(f'{n} {k}' for k, n in sorted(by_status.items()))}) -> {output}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from deepinfer.eval.report import format_report, plot, summarize
    from deepinfer.eval.scoring import Score

    if not args.scores.is_file():
        raise FileNotFoundError(f"no score file at {args.scores}; run `deepinfer eval score` first")
    lines = args.scores.read_text(encoding="utf-8").splitlines()
    scores = [Score.model_validate_json(line) for line in lines if line.strip()]
    stem = args.scores.with_suffix("")
    output = args.output or stem.with_name(stem.name + "_report.json")
    reports = []
    for benchmark in sorted({s.benchmark for s in scores}):
        summary = summarize([s for s in scores if s.benchmark == benchmark])
        print(format_report(summary))
        reports.append(summary)
    output.write_text(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2) + "\n", encoding="utf-8")
    print(f"summary -> {output}")
    if not args.no_plot and len(reports) == 1:
        image = output.with_suffix(".png")
        print(f"plot -> {image}" if plot(reports[0], image) else "no plot: matplotlib is not installed")
    return 0


def cmd_list() -> int:
    from deepinfer.eval.benchmarks import BENCHMARKS

    for b in BENCHMARKS.values():
        print(f"{b.name:<8} {b.samples:>3} samples/task  {b.description}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from deepinfer.eval.backends import EndpointError
    from deepinfer.parallel.launch import RankFailed
    from deepinfer.parallel.layout import ParallelConfigError
    from deepinfer.plugins import PluginError

    refusals = (ValueError, FileNotFoundError, PluginError, ParallelConfigError, EndpointError)
    try:
        if args.stage == "generate":
            return cmd_generate(args)
        if args.stage == "score":
            return cmd_score(args)
        if args.stage == "report":
            return cmd_report(args)
        return cmd_list()
    except refusals as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RankFailed as e:
        cause = e.exception
        print(f"error: {cause if isinstance(cause, refusals) else e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # the rows written so far stay; a forward running on a worker thread cannot be stopped
        # mid-kernel, and waiting for it is not what Ctrl-C asks for
        print("interrupted: the samples written so far are kept; run the same command again to resume",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
