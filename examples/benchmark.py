"""Benchmark your node: prefill and decode throughput of the engine (the seeds' examples/benchmark.py).

    python examples/benchmark.py                                   # the seeds' defaults (accelerator sizes)
    python examples/benchmark.py --preset cpu                      # about a minute on a 2-core CPU
    python examples/benchmark.py --preset cpu --model_name /tmp/v4-bench --roofline --repeats 3
    python examples/benchmark.py --decode_num_requests 1           # low-latency, batch 1
    python examples/benchmark.py --cp 8 --prefill_batch_size 65536

Node 0 prints three numbers (plus the true accepted-token throughput beside the third):
  prefill throughput   tokens/s/device
  decode avg_SPS       decode steps/s as one sequence sees them, in the window where all decode
  decode throughput    avg_SPS x decode_num_requests x (1 + nextn) / cp  ("full-acceptance
                       accounting": counts 1 + nextn tokens per request per step whatever the
                       drafts' true acceptance, so it overstates output speed when drafts are rejected)
  accepted throughput  tokens actually emitted per second per device in the same window
  with --accept_rate A: avg_SPS x decode_num_requests x (1 + A x verified drafts per step) / cp,
                       the throughput (and per-user speed) if a share A of the verified drafts were
                       accepted (a random-weight drafter accepts almost nothing)

Parallel layout (`deepinfer.benchmarks.layout`): scale = WORLD_SIZE x devices per node (1 on the CPU
back end), ep = scale, --cp divides it, dp = scale / cp. A scale above 1 starts this node's ranks
through the offline example's launcher (`_launch.launch_dp`: the same layout rules and refusals,
--threads_per_rank, devices from DEVICE_OFFSET; several nodes: RANK, MASTER_ADDR, MASTER_PORT as
in docs/parallelism.md). Every rank builds its engine and runs the warm-up and timed phases in
lockstep (each phase ends with the expert-parallel idle round, so all start the next one
together); each DP rank decodes its own decode_num_requests sequences and prefills its own
prompts; the ranks of a CP group run the same ones. Node 0 combines one rank per DP group per
repeat: tokens, sequence steps and accepted tokens summed over the DP ranks, seconds the longest
rank's (the phase's wall time), then divided by the devices (scale) as below: whole-run
throughput per device. Its record keeps every rank's raw runs under "ranks".

While it runs (stderr, node 0): the plan before anything is built (with the flags that shrink the
seeds' accelerator sizes on a CPU), an estimate of the whole run from a short calibration prompt,
another of the timed phases after the warm-up, and progress bars on a terminal
(`deepinfer.benchmarks.progress`).

Method: `deepinfer.benchmarks.workloads`. Accounting: `deepinfer.benchmarks.accounting`. Roofline
(`--roofline`): `deepinfer.benchmarks.roofline` and `model_cost` (per family: `cost_v4`,
`cost_v41`). Environment: WORLD_SIZE, RANK, CUDA_VISIBLE_DEVICES (parallel scale = WORLD_SIZE x
devices per node, 1 on the CPU back end);
DEVICE_OFFSET, MASTER_ADDR, MASTER_PORT;
DEEPINFER_USE_NEXTN_DECODE (speculative draft length nextn, default 5 when speculative decoding is
installed; 0 disables it); PROFILE=1 writes a torch profiler trace of the timed phases and prints
the 20 costliest operators (timings then include profiler overhead: use the trace to see which
kernels run, not to measure speed).

A/B (`--ab NAME=VALUE`, repeatable, and/or `--ab_model DIR`; `deepinfer.benchmarks.ab`): the same
benchmark as side A (the command as given) and side B (those variables set, that checkpoint), one
fresh process per side and round, the side that goes first alternating every round (`--ab_rounds`);
prints each figure per side and the median (min-max) of the per-round ratios B / A, e.g.

    python examples/benchmark.py --preset cpu --model_name /tmp/v4-bench --phase decode \
        --ab DEEPINFER_CPU_HUGE_PAGES=0 --ab_rounds 4
    python examples/benchmark.py --preset cpu --model_name /tmp/v4-bench --phase decode --context_length 128 \
        --ab_model /tmp/v41-bench          # also compares throughput x active parameters per token
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer.benchmarks import ab, accounting, progress, results
from deepinfer.benchmarks.layout import Layout, resolve_layout

from _launch import (REFUSALS, RankContext, RankFailed, check_context_parallel_model, error_line,  # examples/
                     launch_dp, resolve_parallel)
from _speculation import NEXTN_VAR, drafter_unsupported, speculation_off_note  # examples/

# The seeds' defaults (sized for a node of SM100 GPUs) and a CPU preset of the same shape that a
# 2-core machine finishes in about a minute on the `bench` model (`deepinfer make-model DIR --size bench`).
PRESETS: dict[str, dict[str, int]] = {
    "seeds": dict(decode_num_requests=64, context_length=32768, non_cached_tokens=4096, prefill_batch_size=32768,
                  decode_tokens=64, prefill_batches=2),
    "cpu": dict(decode_num_requests=8, context_length=512, non_cached_tokens=512, prefill_batch_size=2048,
                decode_tokens=24, prefill_batches=2),
}
PHASES = ("both", "prefill", "decode", "none")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name", default=None,
                   help="checkpoint directory or Hugging Face id in the local cache (default: "
                        "DEEPINFER_HF_MODEL_DIR, else deepseek-ai/DeepSeek-V4.1-Flash-1017 if the local "
                        "Hugging Face cache holds it, else the embedded default model)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="seeds",
                   help="defaults of the size flags below: 'seeds' (the seeds' values) or 'cpu' (%s)"
                   % ", ".join(f"{k}={v}" for k, v in PRESETS["cpu"].items()))
    p.add_argument("--decode_num_requests", type=int, default=None,
                   help="sequences decoded together per data-parallel group (seeds: 64)")
    p.add_argument("--context_length", type=int, default=None, help="prompt tokens of each decode request (seeds: 32768)")
    p.add_argument("--non_cached_tokens", type=int, default=None,
                   help="fresh prompt tokens of each prefill request (seeds: 4096)")
    p.add_argument("--prefill_batch_size", type=int, default=None,
                   help="prompt tokens per engine step, i.e. max_num_batched_tokens (seeds: 32768)")
    p.add_argument("--decode_tokens", type=int, default=None,
                   help="decode steps timed with every sequence running (seeds preset: 64)")
    p.add_argument("--prefill_batches", type=int, default=None, help="prefill batches timed per repeat (default 2)")
    p.add_argument("--cp", type=int, default=1, help="context parallelism; must divide the parallel scale")
    p.add_argument("--threads_per_rank", type=int, default=None,
                   help="CPU threads of each rank's process when the scale is above 1 (default: cores // ranks "
                        "on this node)")
    p.add_argument("--yoco_clip", action="store_true",
                   help="enable SWA bounded replay (the swa_replay feature) for prefill")
    p.add_argument("--prompt_mode", choices=("text", "image"), default="text", help="input type of the prompts")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto", help="model dtype")
    p.add_argument("--phase", choices=PHASES, default="both",
                   help="which phases to time ('none' with --roofline: only the machine and model bounds)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run prefill and decode alternately this many times; figures are medians")
    p.add_argument("--roofline", action="store_true",
                   help="also measure memory bandwidth and bf16 matmul throughput (right before every timed "
                        "phase) and print each figure as a fraction of its bound")
    p.add_argument("--no_warmup", action="store_true", help="skip the untimed warm-up requests")
    p.add_argument("--accept_rate", type=_share, default=None,
                   help="also report decode throughput and per-user speed as if this share (0..1) of the verified "
                        "drafts were accepted: avg_SPS x decode_num_requests x (1 + accept_rate x verified drafts "
                        "per step) / cp (random-weight drafters accept almost nothing)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--result_jsonl", default=None, help="append one JSON object with the raw quantities here")
    p.add_argument("--tag", default="", help="free text stored in the result record (e.g. a sweep tag)")
    p.add_argument("--profile_dir", default="profiles", help="where PROFILE=1 writes its trace")
    ab.add_arguments(p)
    return p


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a share between 0 and 1") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not between 0 and 1")
    return value


@dataclass(frozen=True)
class Settings:
    decode_num_requests: int
    context_length: int
    non_cached_tokens: int
    prefill_batch_size: int
    decode_tokens: int
    prefill_batches: int


def planned_work(settings: Settings) -> progress.Work:
    """What one repeat of the timed phases runs on each data-parallel rank."""
    prefill_requests = -(-settings.prefill_batches * settings.prefill_batch_size // settings.non_cached_tokens)
    return progress.Work(prefill_prompts=prefill_requests, prompt_len=settings.non_cached_tokens,
                         decode_sequences=settings.decode_num_requests, context_len=settings.context_length,
                         decode_steps=settings.decode_tokens)


def _stderr_note(enabled: bool):
    return (lambda text: print(text, file=sys.stderr, flush=True)) if enabled else (lambda text: None)


def resolve_settings(args: argparse.Namespace) -> Settings:
    """Size flags: explicit value > preset > error for values that cannot run."""
    preset = PRESETS[args.preset]
    values = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in preset.items()}
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name} {value} must be >= 1")
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats} must be >= 1")
    return Settings(**values)


def check_prompt_mode(mode: str) -> None:
    if mode == "image":
        raise ValueError("--prompt_mode image is not supported by this model: deepinfer runs DeepSeek-V4 and V4.1 "
                         "on text only (V4 has no vision encoder; V4.1's vision tower is not run). "
                         "Use --prompt_mode text.")


def engine_nextn(llm: Any) -> int:
    """The engine's speculative draft length, nextn (0 when it runs without speculation)."""
    stats = getattr(llm.engine, "spec_stats", None)
    return int(stats.num_draft_tokens) if stats is not None else 0


def planned_nextn() -> int:
    """The nextn the engine will be built with: DEEPINFER_USE_NEXTN_DECODE, else the dspark
    feature's default (the seeds' 5); 0 when speculative decoding is not installed."""
    from deepinfer import envs
    from deepinfer.plugins import feature_specs

    specs, _ = feature_specs()
    if "dspark" not in specs:
        return 0
    raw = envs.get("DEEPINFER_USE_NEXTN_DECODE")
    if raw is not None:
        try:
            return max(0, int(raw))
        except ValueError:
            raise ValueError(f"DEEPINFER_USE_NEXTN_DECODE={raw!r} is not an integer; set the draft length "
                             f"(0 disables speculation)") from None
    return int(getattr(specs["dspark"][1].config_model(), "num_draft_tokens", 0))


def _accelerator_name() -> str:
    """The back end the engine will pick (its fallback warning is left to the engine to print)."""
    import logging

    from deepinfer.plugins import select_accelerator_class

    log = logging.getLogger("deepinfer")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return select_accelerator_class().name
    finally:
        log.setLevel(level)


def check_yoco_clip(enabled: bool) -> None:
    from deepinfer.plugins import FEATURE_GROUP, discover

    if enabled and "swa_replay" not in discover(FEATURE_GROUP):
        raise ValueError("--yoco_clip needs SWA bounded replay (the swa_replay feature), which is not installed "
                         "in this deepinfer; run without --yoco_clip")
    # the variable would win over the feature table --yoco_clip adds (and switch replay off)
    if enabled and os.environ.get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "").strip() == "off":
        raise ValueError("--yoco_clip turns SWA bounded replay on, but DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=off "
                         "turns it off; unset the variable (or set it to compact), or run without --yoco_clip")


def _speculation_env_note() -> str | None:
    """DEEPINFER_USE_NEXTN_DECODE=0 asks for no speculation; without the dspark feature that is
    already the case, so drop the variable instead of letting the engine warn that nothing reads it."""
    from deepinfer.plugins import FEATURE_GROUP, discover

    if "dspark" in discover(FEATURE_GROUP):
        return None
    # without dspark nothing declares the variable (envs.get would refuse the name): look at it raw
    if os.environ.get("DEEPINFER_USE_NEXTN_DECODE", "").strip() != "0":
        return None
    os.environ.pop("DEEPINFER_USE_NEXTN_DECODE", None)
    return "DEEPINFER_USE_NEXTN_DECODE=0: speculative decoding is not installed, so there is nothing to disable"


def _speculation_model_note(model_name: str | None) -> str | None:
    """Speculative decoding is on by default when it is installed (the seeds); a model whose family
    cannot draft yet (DeepSeek-V4.1, see `_speculation.py`) runs without it instead: this run gets
    DEEPINFER_USE_NEXTN_DECODE=0 and a note. A value the user set is kept (> 0 there is the engine's error),
    and so is a configuration file's choice (DEEPINFER_CONFIG: its [features.dspark] table decides)."""
    if NEXTN_VAR in os.environ or os.environ.get("DEEPINFER_CONFIG"):
        return None
    default = planned_nextn()
    reason = drafter_unsupported(model_name) if default > 0 else None
    if not reason:
        return None
    os.environ[NEXTN_VAR] = "0"
    return speculation_off_note(str(default), reason)


def _profiler(enabled: bool):
    if not enabled:
        return None
    import torch
    import torch.profiler as tp

    # the async pipeline runs the forward on a worker thread: record every thread, not just this one
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    return tp.profile(activities=[tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if _cuda_available() else []),
                      experimental_config=config)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _fmt(fig: dict[str, float] | None, unit: str, digits: int = 1) -> str:
    if fig is None:
        return "n/a"
    text = f"{fig['median']:,.{digits}f}" + (f" {unit}" if unit else "")
    if fig["n"] > 1:
        text += f" (median of {fig['n']}; min {fig['min']:,.{digits}f}, max {fig['max']:,.{digits}f})"
    return text


def format_figures(record: dict[str, Any]) -> str:
    f = results.figures(record)
    cp, nextn, req = record["layout"]["cp"], record["nextn"], record["settings"]["decode_num_requests"]
    lines = []
    if record.get("prefill"):
        p = record["prefill"][0]
        lines.append(f"prefill throughput: {_fmt(f['prefill_tokens_per_s_per_device'], 'tokens/s/device')}"
                     f"   [{p['requests']} prompts x {p['prompt_len']} tokens, "
                     f"{record['settings']['prefill_batch_size']} tokens per step]")
    if record.get("decode"):
        d = record["decode"][0]
        spec = (f"speculation off (nextn 0)" if not nextn else
                f"speculation on, nextn {nextn}, draft acceptance {_fmt(f['decode_draft_accept_rate'], '', 2)}")
        lines += [
            f"decode avg_SPS: {_fmt(f['decode_avg_sps'], 'steps/s', 2)}"
            f"   [{d['requests']} sequences at context {d['context_len']}, {d['steps']} engine steps timed; {spec}]",
            f"decode throughput, full-acceptance accounting (avg_SPS x {req} x (1 + nextn={nextn}) / cp={cp}): "
            f"{_fmt(f['decode_full_acceptance_tokens_per_s_per_device'], 'tokens/s/device')}",
            f"decode throughput, accepted tokens (measured): "
            f"{_fmt(f['decode_accepted_tokens_per_s_per_device'], 'tokens/s/device')}"
            f"   [per user {_fmt(f['decode_per_user_tokens_per_s'], 'tokens/s')}; "
            f"{f['decode_acceptance_length']['median']:.2f} tokens per sequence per step]",
        ]
        accept = record["settings"].get("accept_rate")
        if accept is not None:
            v = f["decode_verified_drafts_per_step"]["median"]
            lines.append(
                f"decode throughput at accept_rate {accept:g} (avg_SPS x {req} x (1 + {accept:g} x {v:.2f} verified "
                f"drafts per step) / cp={cp}): "
                f"{_fmt(f['decode_assumed_acceptance_tokens_per_s_per_device'], 'tokens/s/device')}"
                f"   [per user {_fmt(f['decode_assumed_acceptance_per_user_tokens_per_s'], 'tokens/s')}"
                + ("; no drafts verified: speculation off" if not v else "") + "]")
    return "\n".join(lines)


def _model_config(llm: Any, model_name: str | None) -> tuple[Any, str, str]:
    """(parsed config, dtype name, model_type) of the engine's model, or, without an engine
    (`--phase none`), of the checkpoint, parsed by the family its config.json names."""
    if llm is not None:
        info = llm.build_info
        return llm.engine.model.config, str(info.dtype).replace("torch.", ""), info.model_type
    from deepinfer.benchmarks.model_cost import checkpoint_config
    from deepinfer.models.resolve import resolve_model

    config, raw, model_type = checkpoint_config(resolve_model(model_name).path)
    return config, raw.get("dtype") or raw.get("torch_dtype") or "bfloat16", model_type


def run(args: argparse.Namespace, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The whole benchmark; returns the result record (rank 0 prints it)."""
    env = dict(os.environ) if env is None else env
    settings = resolve_settings(args)
    check_prompt_mode(args.prompt_mode)
    check_yoco_clip(args.yoco_clip)
    accelerator = _accelerator_name()
    layout: Layout = resolve_layout(args.cp, accelerator, env)
    say = print if layout.rank == 0 else (lambda *a, **k: None)
    for note in (_speculation_env_note(), _speculation_model_note(args.model_name)):
        if note:
            say(note)
    profile = env.get("PROFILE", "").strip() not in ("", "0")
    # the launcher's rules and refusals (nodes, devices, CP support) before anything starts
    parallel = resolve_parallel(layout.ep, layout.dp, layout.cp, accelerator, env)
    check_context_parallel_model(args.model_name, parallel.cp)
    if args.phase != "none":
        _stderr_note(layout.rank == 0)(progress.plan_text(
            planned_work(settings), args.phase, args.repeats, settings.prefill_batch_size, args.preset, accelerator,
            layout.scale, warmup=not args.no_warmup))

    ranks: list[dict] = []
    if args.phase != "none":
        from deepinfer.plugins import select_accelerator_class

        ranks = launch_dp(bench_rank, parallel, select_accelerator_class(accelerator), (args, settings, profile),
                          threads_per_rank=args.threads_per_rank)
    first = ranks[0] if ranks else None
    groups = [r for r in ranks if r["cp_rank"] == 0]  # one rank per DP group (a CP group runs the same requests)
    prefill_runs = [results.combine_runs([g["prefill"][i] for g in groups]) for i in range(len(first["prefill"]))] \
        if first else []
    decode_runs = [results.combine_runs([g["decode"][i] for g in groups]) for i in range(len(first["decode"]))] \
        if first else []

    config, dtype, model_type = (first["config"], first["dtype"], first["model_type"]) if first else \
        _model_config(None, args.model_name)
    if first is None and args.dtype != "auto":
        dtype = args.dtype  # what the engine would have run
    record: dict[str, Any] = {
        "schema": results.SCHEMA,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tag": args.tag,
        "argv": list(getattr(args, "_argv", [])),
        "settings": dict(vars(settings), preset=args.preset, cp=args.cp, yoco_clip=args.yoco_clip,
                         accept_rate=args.accept_rate,
                         prompt_mode=args.prompt_mode, phase=args.phase, repeats=args.repeats, seed=args.seed),
        "layout": {"world_size": layout.world_size, "rank": layout.rank, "devices_per_node": layout.devices_per_node,
                   "scale": layout.scale, "cp": layout.cp, "dp": layout.dp, "ep": layout.ep,
                   "accelerator": accelerator},
        "model": {"name": args.model_name, "path": first["model_path"] if first else None, "dtype": dtype,
                  "model_type": model_type,
                  "hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
                  "n_routed_experts": config.n_routed_experts, "num_experts_per_tok": config.num_experts_per_tok,
                  "vocab_size": config.vocab_size},
        "engine": first["engine"] if first else None,
        "nextn": first["nextn"] if first else 0,
        "profile": profile,
        "threads": first["threads"] if first else _threads(),
        "prefill": prefill_runs,
        "decode": decode_runs,
        "roofline": None,
    }
    if parallel.world_size > 1:  # every rank's raw runs (on node 0 of several nodes: the world's)
        record["ranks"] = [{k: r[k] for k in ("rank", "dp_rank", "cp_rank", "prefill", "decode")} for r in ranks]
    if args.roofline:
        record["roofline"], record["_roofline_text"] = _roofline(record, config, dtype, settings)
    return record


def bench_rank(ctx: RankContext, args: argparse.Namespace, settings: Settings, profile: bool) -> dict[str, Any]:
    """One rank: build the engine for its place in the layout, run the phases, return its raw runs
    and what the record says about the engine (the whole run in-process when the scale is 1)."""
    from deepinfer import LLM

    say = print if ctx.is_first else (lambda *a, **k: None)
    layout = ctx.layout
    llm = LLM(**_engine_kwargs(args, settings, layout if not layout.is_single else None,
                               settings.decode_num_requests, planned_nextn()))
    prefill_runs, decode_runs = _timed_phases(llm, args, settings, settings.decode_num_requests, profile, ctx.rank,
                                              say, ctx.dp_rank)
    config, dtype, model_type = _model_config(llm, args.model_name)
    out = {"rank": ctx.rank, "dp_rank": ctx.dp_rank, "cp_rank": ctx.rank % layout.cp,
           "prefill": prefill_runs, "decode": decode_runs, "config": config, "dtype": dtype, "model_type": model_type,
           "model_path": llm.build_info.model_path,
           "engine": {k: getattr(llm.config, k) for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                                          "async_pipeline", "dtype")},
           "nextn": engine_nextn(llm), "threads": _threads()}
    llm.shutdown()
    return out


WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS = 64, 4


def _engine_kwargs(args: argparse.Namespace, settings: Settings, parallel: Any, sequences: int,
                   nextn: int) -> dict[str, Any]:
    """LLM(...) arguments sized for the phases that will run (`sequences`: this engine's decode
    batch; `parallel`: the rank's ParallelLayout, None in one process). Speculative decoding is on whenever
    it is installed, as in the seeds (DEEPINFER_USE_NEXTN_DECODE=0 turns it off)."""
    from deepinfer.benchmarks import workloads

    prefill, decode = args.phase in ("both", "prefill"), args.phase in ("both", "decode")
    prefill_seqs_per_step = -(-settings.prefill_batch_size // settings.non_cached_tokens)
    decode_len = settings.context_length + workloads.decode_max_tokens(
        sequences, settings.context_length, settings.decode_tokens, settings.prefill_batch_size, nextn)
    kwargs: dict[str, Any] = dict(
        model=args.model_name, dtype=args.dtype,
        max_num_seqs=max(sequences if decode else 2, prefill_seqs_per_step if prefill else 2),
        max_num_batched_tokens=settings.prefill_batch_size,
        max_model_len=max(decode_len if decode else 0, settings.non_cached_tokens + 1 if prefill else 0,
                          WARMUP_PROMPT_TOKENS + WARMUP_OUTPUT_TOKENS))
    if parallel is not None:
        kwargs.update(ep=parallel.ep, dp=parallel.dp, cp=parallel.cp)
    features: dict[str, dict] = {}
    if nextn > 0:
        features["dspark"] = {}  # the draft length comes from DEEPINFER_USE_NEXTN_DECODE / the config file
    if args.yoco_clip:
        features["swa_replay"] = {}
    if features:
        kwargs["features"] = features
    return kwargs


CALIBRATION_PROMPT_TOKENS, CALIBRATION_OUTPUT_TOKENS = 256, 6


def _note_calibrated_estimate(llm: Any, args: argparse.Namespace, settings: Settings, work: progress.Work,
                              sequences: int, synced, note) -> None:
    """Before the warm-up (whose one full prefill step alone can take minutes on a CPU): time one
    short prompt and a few decode steps, twice (the first pays first-call costs), and say how long
    the whole run will take at that speed."""
    from deepinfer.benchmarks import workloads

    length = max(1, min(CALIBRATION_PROMPT_TOKENS, llm.config.max_model_len - CALIBRATION_OUTPUT_TOKENS - 1))
    params = workloads.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=CALIBRATION_OUTPUT_TOKENS)
    for seed in (10**6 + 5, 10**6 + 7):
        prompt = workloads.random_prompts(1, length, llm.engine.vocab_size, seed=seed)
        _, trace = synced(workloads.run_requests(llm, prompt, params))
    tokens_per_s = workloads.tokens_per_second(trace, length)
    if not tokens_per_s:
        return
    speed = progress.Speed(tokens_per_s, workloads.decode_step_seconds(trace), f"a {length}-token calibration prompt")
    warmup_tokens, warmup_steps = 0, 0
    if args.phase in ("both", "prefill"):
        warmup_tokens += 2 * -(-settings.prefill_batch_size // settings.non_cached_tokens) * settings.non_cached_tokens
    if args.phase in ("both", "decode"):
        warmup_tokens += sequences * min(settings.non_cached_tokens, WARMUP_PROMPT_TOKENS)
        warmup_steps += WARMUP_OUTPUT_TOKENS
    seconds = progress.estimate_seconds(work, args.phase, args.repeats, speed, warmup_tokens, warmup_steps)
    if seconds is not None:
        note(progress.estimate_text(seconds, speed, "the warm-up and the timed phases take"))


def _watched(label: str, rank: int, run, decode_steps: int | None = None):
    """`run(progress)` with progress bars on node 0's first rank (on a terminal; see deepinfer.benchmarks.progress)."""
    bars = progress.PhaseProgress(label, decode_steps=decode_steps, enabled=None if rank == 0 else False)
    try:
        return run(bars.update)
    finally:
        bars.close()


def _timed_phases(llm: Any, args: argparse.Namespace, settings: Settings, sequences: int, profile: bool,
                  rank: int, say, dp_rank: int = 0) -> tuple[list[dict], list[dict]]:
    """Warm-up, then prefill and decode alternately `--repeats` times; raw results per repeat. Every
    run ends with the expert-parallel idle round (a no-op in one process): a rank that is done serves
    its peers' experts until all are, so the ranks start each phase together. Each DP rank draws
    its own prompts (`dp_rank` shifts the seeds; DP rank 0 uses today's)."""
    from deepinfer.benchmarks import workloads
    from deepinfer.parallel.expert_parallel import idle_until_peers_done

    def synced(result):
        idle_until_peers_done()
        return result

    def machine() -> dict | None:  # measured right before each timed phase (--roofline)
        if not args.roofline:
            return None
        from deepinfer.benchmarks import roofline

        return roofline.measure_machine(trials=3).to_json()

    vocab = llm.engine.vocab_size
    work = planned_work(settings)
    note = _stderr_note(rank == 0)
    prefill_speed = decode_step = None
    if not args.no_warmup:
        _note_calibrated_estimate(llm, args, settings, work, sequences, synced, note)
        # First-call costs stay out of the timings: allocation, kernel selection, and on the cpu
        # back end oneDNN's JIT compilation of every new GEMM shape (~3 ms each), so the warm-up
        # runs one full prefill step and decode at the timed batch size. The prefill warm-up runs
        # twice: the cpu back end packs a weight at its second use in a row range (55 ms for a
        # 129k x 512 LM head), which would otherwise land in the first timed prefill.
        short = min(settings.non_cached_tokens, WARMUP_PROMPT_TOKENS)
        greedy = dict(temperature=0.0, ignore_eos=True)
        if args.phase in ("both", "prefill"):
            step = -(-settings.prefill_batch_size // settings.non_cached_tokens)
            for i, seed in enumerate((10**6 + 1, 10**6 + 3)):
                warm = workloads.random_prompts(step, settings.non_cached_tokens, vocab, seed=seed)
                _, trace = synced(_watched(f"warm-up prefill {i + 1}/2", rank, lambda bars: workloads.run_requests(
                    llm, warm, workloads.SamplingParams(max_tokens=1, **greedy), progress=bars)))
            prefill_speed = workloads.tokens_per_second(trace, step * settings.non_cached_tokens)  # the second run
        if args.phase in ("both", "decode"):
            warm = workloads.random_prompts(sequences, short, vocab, seed=10**6 + 2)
            _, trace = synced(_watched("warm-up decode", rank, lambda bars: workloads.run_requests(
                llm, warm, workloads.SamplingParams(max_tokens=WARMUP_OUTPUT_TOKENS, **greedy), progress=bars)))
            decode_step = workloads.decode_step_seconds(trace)
            if prefill_speed is None:  # decode only: its prompts' prefill is the speed to go by
                prefill_speed = workloads.tokens_per_second(trace, sequences * short)
        if prefill_speed:
            speed = progress.Speed(prefill_speed, decode_step, "the warm-up")
            seconds = progress.estimate_seconds(work, args.phase, args.repeats, speed)
            if seconds is not None:
                note(progress.estimate_text(seconds, speed, "the timed phases take"))
    prefill_requests = work.prefill_prompts
    prefill_runs: list[dict] = []
    decode_runs: list[dict] = []
    profiler = _profiler(profile)
    if profiler is not None:
        profiler.__enter__()
    try:
        for r in range(args.repeats):
            seed = args.seed + 2 * (dp_rank * args.repeats + r)
            of = f" {r + 1}/{args.repeats}" if args.repeats > 1 else ""
            if args.phase in ("both", "prefill"):
                prompts = workloads.random_prompts(prefill_requests, settings.non_cached_tokens, vocab, seed=seed)
                m = machine()
                run = synced(_watched(f"prefill phase{of}", rank, lambda bars: workloads.run_prefill(
                    llm, prompts, settings.prefill_batch_size, profiler, progress=bars)))
                prefill_runs.append(dict(run.to_json(), machine=m))
            if args.phase in ("both", "decode"):
                prompts = workloads.random_prompts(sequences, settings.context_length, vocab, seed=seed + 1)
                m = machine()
                run = synced(_watched(f"decode phase{of}", rank, lambda bars: workloads.run_decode(
                    llm, prompts, settings.decode_tokens, settings.prefill_batch_size, engine_nextn(llm), profiler,
                    progress=bars), decode_steps=settings.decode_tokens))
                decode_runs.append(dict(run.to_json(), machine=m))
    finally:
        if profiler is not None:
            profiler.__exit__(None, None, None)
    if profiler is not None:
        out = Path(args.profile_dir) / f"trace_rank{rank}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(out))
        say(f"PROFILE=1: trace written to {out} (timings below include profiler overhead)")
        say("where the time went (operators by self CPU time, every thread):")
        say(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=48))
    return prefill_runs, decode_runs


def _roofline(record: dict[str, Any], config, dtype: str, settings: Settings) -> tuple[dict, str]:
    """Cost of the workload (one engine's: decode_num_requests sequences), the machine measured
    before each phase, and the report text."""
    from deepinfer.benchmarks import model_cost, roofline

    float_bytes = model_cost.dtype_bytes(dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16")
    cost = roofline.workload_cost(config, prefill_len=settings.non_cached_tokens, decode_batch=settings.decode_num_requests,
                                  decode_context=settings.context_length, float_bytes=float_bytes)
    runs = record["prefill"] + record["decode"]
    machines = [roofline.Machine.from_json(r["machine"]) for r in runs] or [roofline.measure_machine(trials=3)]
    devices = record["layout"]["scale"]
    prefill = [(accounting.prefill_throughput(r["tokens"], r["seconds"], devices),
                roofline.Machine.from_json(r["machine"])) for r in record["prefill"]]
    decode = [(accounting.decode_avg_sps(r["steps"], r["seconds"]), roofline.Machine.from_json(r["machine"]))
              for r in record["decode"]]
    data = {"cost": cost.to_json(), "machines": [m.to_json() for m in machines] if not runs else None}
    return data, roofline.report(cost, machines, prefill, decode)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def run_ab(argv: list[str], result_jsonl: str | None) -> str:
    """A/B mode (`--ab`, `--ab_model`): this command line as side A and with side B's changes, in
    fresh processes, alternating; returns the summary. Each run's record is appended to
    `result_jsonl` with its side, round and changes under "ab"."""
    options, rest = ab.split_argv(argv)
    sides = {side.name: side for side in ab.sides_of(options)}
    note = _stderr_note(True)

    def on_record(r: int, name: str, record: dict[str, Any]) -> None:
        f = results.figures(record)
        shown = "; ".join(f"{label} {f[key]['median']:,.2f}" for key, label in ab.FIGURES if f[key])
        note(f"A/B round {r + 1}/{options.ab_rounds}, side {name}: {shown or 'no figure'}")
        if result_jsonl:
            side = sides[name]
            results.append_jsonl(result_jsonl, dict(record, ab={"side": name, "round": r, "env": side.env,
                                                                "model": side.model}))

    records = ab.run_sides([sys.executable, str(Path(__file__).resolve()), *rest], list(sides.values()),
                           options.ab_rounds, on_record=on_record)
    rows = ab.summarise(records, ab.active_params_if_models_differ(records))
    return ab.format_summary(rows, list(sides.values()), options.ab_rounds)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args._argv = argv
    if args.ab or args.ab_model:
        try:
            print(run_ab(argv, args.result_jsonl))
        except (*REFUSALS, RuntimeError) as e:  # RuntimeError: a side's process failed (ab.RunFailed)
            print(error_line(e), file=sys.stderr)
            return 2
        if args.result_jsonl:
            print(f"every run's record appended to {args.result_jsonl}")
        return 0
    try:
        record = run(args)
    except (*REFUSALS, RankFailed, RuntimeError) as e:  # RuntimeError: e.g. a benchmark request the engine refused
        print(error_line(e), file=sys.stderr)
        return 2
    roofline_text = record.pop("_roofline_text", None)
    if record["layout"]["rank"] > 0:
        print(f"node {record['layout']['rank']} of {record['layout']['world_size']}: node 0 prints the figures",
              file=sys.stderr)
    else:
        text = format_figures(record)
        if text:
            print(text)
        if roofline_text:
            print(roofline_text)
        if args.result_jsonl:
            results.append_jsonl(args.result_jsonl, record)
            print(f"result appended to {args.result_jsonl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
