"""Measure DSpark speculative decoding: speculation off, fixed k drafts, and variable length.

    python examples/bench_spec.py                                # embedded default model, batch 1 and 32
    python examples/bench_spec.py --batch_sizes 1 8 --max_tokens 64 --rounds 3
    python examples/bench_spec.py --self_draft                   # also a confident drafter (test mode)
    python examples/bench_spec.py --model_name DIR --json spec.json

For each batch size it builds one engine per mode, runs the same greedy workload on each in
alternating rounds (CPU timings drift, so the report is the median of the rounds) and reports:

- tokens/s: generated tokens per second of `generate` (short prompts, so prefill is a small part);
- accept rate (accepted / verified drafts), mean accepted length (tokens per request per step,
  bonus included), drafts verified per request per step, acceptance by draft position;
- whether the outputs equal speculation off (greedy decoding must be lossless);
- for variable length: drafts verified per request-step by the calibrated confidence of its first
  draft, which shows the schedule verifying fewer drafts when the drafter is unsure.

Prompts (`--prompt_source`): "heldout" cuts them from the demo model's held-out Shakespeare (the
text its trainer never saw; the default for the embedded default model, whose drafter is trained),
"random" draws random token ids (the default for other models, whose drafters are usually random
too and rarely accepted). `--self_draft` adds the test-mode drafter (the target drafts for itself:
every greedy draft is accepted, at about k extra target forwards per step) to show the schedule and
the bookkeeping with high confidence; it is not a speed-up.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

BUCKETS = (0.0, 0.001, 0.01, 0.1, 0.5, 1.0000001)  # first-draft confidence buckets


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name", default=None, help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt_tokens", type=int, default=32)
    p.add_argument("--prompt_source", choices=["auto", "heldout", "random"], default="auto",
                   help="heldout: the demo model's held-out text; random: random ids; auto: heldout for the "
                        "embedded default model, else random")
    p.add_argument("--max_tokens", type=int, default=48)
    p.add_argument("--num_draft_tokens", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="weights and activations (default: the checkpoint's); greedy outputs are compared with "
                        "speculation off, which in bfloat16 also differs between batch shapes")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--self_draft", action="store_true", help="add variable length with the self-drafting test mode")
    p.add_argument("--json", default=None, help="write every figure to this file")
    args = p.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.max_tokens < 2 or args.rounds < 1 or args.num_draft_tokens < 1:
        p.error("batch sizes, --rounds and --num_draft_tokens must be >= 1 and --max_tokens >= 2")
    return args


def modes(args) -> dict[str, dict | None]:
    k = args.num_draft_tokens
    out = {"off": None, f"fixed k={k}": {"num_draft_tokens": k},
           "variable length": {"num_draft_tokens": k, "variable_length": True}}
    if args.self_draft:
        out["variable length, self drafter"] = {"num_draft_tokens": k, "variable_length": True, "drafter": "self"}
    return out


def counters(stats) -> dict:
    if stats is None:
        return {}
    return dict(steps=stats.num_steps, verifications=stats.num_verifications, verified=stats.num_drafts_verified,
                accepted=stats.num_drafts_accepted, emitted=stats.num_tokens_emitted,
                verified_at=list(stats.verified_at), accepted_at=list(stats.accepted_at))


def combine(a: dict, b: dict, sign: int = 1) -> dict:
    """a + sign * b, counter by counter (lists element-wise)."""
    return {k: [x + sign * y for x, y in zip(v, b[k])] if isinstance(v, list) else v + sign * b[k]
            for k, v in a.items()}


def record_schedule(llm, trace: list[tuple[float, int]]) -> None:
    """Log (calibrated first-draft confidence, drafts kept) of each request the variable-length plan sees."""
    policy = llm.engine.speculator.policy
    plan = policy.plan

    def traced(confidences, draft_seconds):
        first = [policy.calibrator.calibrate(0, c[0]) for c in confidences]
        chosen = plan(confidences, draft_seconds)
        trace.extend(zip(first, chosen))
        return chosen

    policy.plan = traced


def run_batch(args, batch: int) -> dict:
    from deepinfer import LLM, SamplingParams

    engines = {}
    for name, dspark in modes(args).items():
        t0 = time.perf_counter()
        engines[name] = LLM(model=args.model_name, dtype=args.dtype, max_num_seqs=batch,
                            max_model_len=args.prompt_tokens + args.max_tokens + args.num_draft_tokens + 8,
                            max_num_batched_tokens=max(batch * (args.num_draft_tokens + 1), args.prompt_tokens * batch),
                            features=None if dspark is None else {"dspark": dspark})
        engines[name].start_seconds = time.perf_counter() - t0
    prompts = make_prompts(args, batch, engines["off"])
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    schedules: dict[str, list] = {}
    for name, llm in engines.items():
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        if llm.engine.speculator is not None and llm.engine.speculator.policy is not None:
            schedules[name] = []
            record_schedule(llm, schedules[name])
    speeds: dict[str, list[float]] = {n: [] for n in engines}
    step_ms: dict[str, list[float]] = {n: [] for n in engines}  # wall time per engine step (prefill included)
    spec: dict[str, dict] = {}
    outputs: dict[str, list] = {}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            before = counters(llm.engine.spec_stats)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            speeds[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
            outputs[name] = [o.outputs[0].token_ids for o in outs]
            steps = args.max_tokens
            if before:
                d = combine(counters(llm.engine.spec_stats), before, -1)
                spec[name] = combine(spec[name], d) if name in spec else d
                steps = max(d["steps"], 1)
            step_ms[name].append(seconds * 1e3 / steps)
    result = {"batch": batch, "modes": {}}
    base = statistics.median(speeds["off"])
    for name, llm in engines.items():
        row = {"tokens_per_s": statistics.median(speeds[name]), "speedup": statistics.median(speeds[name]) / base,
               "lossless": outputs[name] == outputs["off"], "start_seconds": llm.start_seconds,
               "ms_per_step": statistics.median(step_ms[name])}
        if llm.engine.speculator is not None:  # the drafter's share of a step (a moving average)
            row["draft_ms_per_step"] = llm.engine.speculator.draft_seconds * 1e3
        if name in spec:
            c = spec[name]
            row.update(accept_rate=c["accepted"] / c["verified"] if c["verified"] else None,
                       mean_accepted_length=c["emitted"] / c["verifications"] if c["verifications"] else None,
                       verified_drafts_per_request_step=c["verified"] / c["verifications"] if c["verifications"] else None,
                       acceptance_by_position=[a / v if v else None for a, v in zip(c["accepted_at"], c["verified_at"])])
        if name in schedules:
            row["schedule_by_confidence"] = bucket(schedules[name])
            row["verify_cost_ms"] = {str(b): [(t, round(s * 1e3, 2)) for t, s in pts]
                                     for b, pts in llm.engine.speculator.policy.cost_model.table.items()}
        result["modes"][name] = row
        llm.shutdown()
    return result


def make_prompts(args, batch: int, llm) -> list[list[int]]:
    """`batch` prompts of `--prompt_tokens` ids: cut at even strides from the demo model's held-out
    text, or random ids (see `--prompt_source`)."""
    source = args.prompt_source
    if source == "auto":
        source = "heldout" if llm.build_info.is_default_model else "random"
    if source == "random":
        rng = random.Random(batch)
        vocab = llm.engine.vocab_size
        return [[rng.randrange(3, min(vocab, 128000)) for _ in range(args.prompt_tokens)] for _ in range(batch)]
    from deepinfer.models.deepseek_v41.demo_model import SHIPPED_FILE, held_out_windows

    stream = held_out_windows(SHIPPED_FILE).flatten().tolist()
    stride = (len(stream) - args.prompt_tokens) // batch
    if stride < 1:
        raise SystemExit(f"error: the held-out text ({len(stream)} tokens) is too short for {batch} prompts of "
                         f"{args.prompt_tokens} tokens; use fewer or shorter prompts, or --prompt_source random")
    return [stream[i * stride: i * stride + args.prompt_tokens] for i in range(batch)]


def bucket(trace: list[tuple[float, int]]) -> list[dict]:
    rows = []
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        kept = [m for c, m in trace if lo <= c < hi]
        if kept:
            rows.append({"confidence": f"[{lo:g}, {min(hi, 1):g}{']' if hi > 1 else ')'}", "request_steps": len(kept),
                         "mean_drafts_verified": sum(kept) / len(kept)})
    return rows


def fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def report(results: list[dict], args) -> str:
    lines = [f"greedy, {args.prompt_tokens}-token prompts ({args.prompt_source}), {args.max_tokens} new tokens, median of {args.rounds} rounds, "
             f"dtype {args.dtype or 'of the checkpoint'}",
             "", "| batch | mode | tokens/s | vs off | lossless | accept rate | accepted length | drafts verified "
                 "per request-step | acceptance by position | ms per step (drafting) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name, m in r["modes"].items():
            pos = " / ".join(fmt(a) for a in m.get("acceptance_by_position", []))
            lines.append(f"| {r['batch']} | {name} | {m['tokens_per_s']:.1f} | {m['speedup']:.2f}x | "
                         f"{'yes' if m['lossless'] else 'NO'} | {fmt(m.get('accept_rate'), '.3f')} | "
                         f"{fmt(m.get('mean_accepted_length'))} | {fmt(m.get('verified_drafts_per_request_step'))} | "
                         f"{pos or '-'} | {m['ms_per_step']:.1f}"
                         + (f" ({m['draft_ms_per_step']:.1f})" if "draft_ms_per_step" in m else "") + " |")
    lines += ["", "variable length: drafts verified per request-step by the (calibrated) confidence of the first draft", "",
              "| batch | mode | first-draft confidence | request-steps | drafts verified |", "|---|---|---|---|---|"]
    for r in results:
        for name, m in r["modes"].items():
            for b in m.get("schedule_by_confidence", []):
                lines.append(f"| {r['batch']} | {name} | {b['confidence']} | {b['request_steps']} | "
                             f"{b['mean_drafts_verified']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from _speculation import drafter_unsupported

    reason = drafter_unsupported(args.model_name)
    if reason:
        print(f"error: {reason}; give --model_name a model that can draft (a DeepSeek-V4 checkpoint with MTP "
              f"weights: deepinfer make-model DIR --size default)", file=sys.stderr)
        return 2
    results = [run_batch(args, b) for b in args.batch_sizes]
    text = report(results, args)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "results": results}, f, indent=1)
    lossy = [f"batch {r['batch']} {n}" for r in results for n, m in r["modes"].items() if not m["lossless"]]
    if lossy:
        print(f"outputs differ from speculation off: {', '.join(lossy)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
