"""One long prefill at --cp 1 and --cp 2 on the cpu back end (gloo): tokens/s and time in collectives.

    .venv/bin/python scripts/bench_context_parallel.py                   # 4096 tokens, 3 rounds
    .venv/bin/python scripts/bench_context_parallel.py --tokens 2048 --rounds 5
    .venv/bin/python scripts/bench_context_parallel.py --family v41      # DeepSeek-V4.1

Builds a random DeepSeek-V4 checkpoint (the `default` preset: hidden 256, 6 layers - sliding, CSA,
HCA - window 32, c4 and c32 compression, indexer top-16; no MTP; with `--family v41` the random
DeepSeek-V4.1 `default` preset: hidden 64, 12 layers - sliding, ratio-2 and ratio-1 KV sources with
their Reuse and Reindex layers, Engram - window 32, index top-16; no DSpark), then per round runs the same
measurement once with one rank and once with a CP group of two (one thread per rank; the side that
goes first alternates every round, `deepinfer.benchmarks.timing`):
each run builds the engine, warms up on a short prompt, then times `--repeats` prefills of
`--tokens` new tokens each (a different prompt each time, so no prefix is reused; one output token).
Printed per run: prefill tokens/s (the median repeat) and, at cp 2, the seconds this rank spent in
the CP all-gathers and the bytes they moved; then the median (min-max) of the per-round ratios of
the cp 2 time to the cp 1 time. Greedy first tokens of cp 1 and cp 2 must agree (exit status 1
otherwise).

On a 2-core host both CP ranks share the cores with everything else: this shows that CP runs and
what its exchange costs, not a speed-up.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from deepinfer.benchmarks.timing import Spread, alternating_rounds, ratios, timed


def run_rank(ctx, checkpoint: str, tokens: int, repeats: int) -> dict:
    import torch

    from deepinfer import LLM
    from deepinfer.parallel.context_parallel import current_context_parallel
    from deepinfer.sampling_params import SamplingParams

    torch.set_num_threads(ctx.threads)  # a one-rank launch runs in this process
    layout = ctx.layout
    llm = LLM(model=checkpoint, accelerator="cpu", dtype="float32", max_num_seqs=1, cache_memory_gb=0.5,
              max_model_len=tokens + 64, max_num_batched_tokens=tokens + 64, cp=layout.cp, dp=layout.dp)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([{"prompt_token_ids": list(range(2, 66))}], params, use_tqdm=False)  # warm-up
    cp = current_context_parallel()
    seconds, gather_s, gather_bytes, first = [], [], [], []
    for r in range(repeats):
        prompt = [(r * 7919 + 31 * i) % 100000 + 2 for i in range(tokens)]
        if cp is not None:
            cp.timing.reset()
        out, elapsed = timed(lambda: llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False))
        seconds.append(elapsed)
        first.append(out[0].outputs[0].token_ids[0])
        if cp is not None:
            gather_s.append(cp.timing.seconds)
            gather_bytes.append(cp.timing.bytes)
    llm.shutdown()
    return {"seconds": seconds, "gather_seconds": gather_s, "gather_bytes": gather_bytes, "first": first}


def measure(checkpoint: str, cp: int, tokens: int, repeats: int) -> dict:
    from deepinfer.parallel.launch import launch
    from deepinfer.parallel.layout import ParallelLayout
    from deepinfer.plugins import load_accelerator_class

    results = launch(run_rank, (checkpoint, tokens, repeats), ParallelLayout(dp=1, cp=cp),
                     load_accelerator_class("cpu"), threads_per_rank=1)
    median = statistics.median(results[0]["seconds"])
    row = {"cp": cp, "seconds": median, "tokens_per_s": tokens / median, "first": results[0]["first"]}
    if cp > 1:
        row["gather_seconds"] = [statistics.median(r["gather_seconds"]) for r in results]
        row["gather_mib"] = results[0]["gather_bytes"][0] / 2 ** 20
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens of each prefill")
    parser.add_argument("--rounds", type=int, default=3, help="cp 1 / cp 2 pairs, alternating")
    parser.add_argument("--repeats", type=int, default=2, help="timed prefills per run (the median counts)")
    parser.add_argument("--family", choices=("v4", "v41"), default="v4", help="the random checkpoint's family")
    parser.add_argument("--json", action="store_true", help="print one JSON object per run")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        if args.family == "v41":
            from deepinfer.models.deepseek_v41.make_model import make_model as make_v41
            checkpoint = str(make_v41(Path(tmp) / "v41", "default", seed=0, with_dspark=False, dtype="float32"))
        else:
            from deepinfer.models.deepseek_v4.make_model import make_model
            checkpoint = str(make_model(Path(tmp) / "v4", "default", seed=0, with_mtp=False, dtype="float32"))

        def report(round_: int, _case, _side: str, row: dict) -> None:
            if args.json:
                print(json.dumps({"round": round_, **row}), flush=True)
                return
            extra = ""
            if row["cp"] > 1:
                share = max(row["gather_seconds"]) / row["seconds"]
                extra = (f"  all-gathers {', '.join(f'{s:.3f}' for s in row['gather_seconds'])} s per rank "
                         f"({share:.0%} of the prefill), {row['gather_mib']:.1f} MiB gathered")
            print(f"round {round_} cp {row['cp']}: {args.tokens} tokens in {row['seconds']:.2f} s = "
                  f"{row['tokens_per_s']:.0f} tokens/s{extra}", flush=True)

        runs = alternating_rounds({f"cp {cp}": (lambda _case, cp=cp: measure(checkpoint, cp, args.tokens, args.repeats))
                                   for cp in (1, 2)}, args.rounds, on_sample=report)[None]
    one, two = runs["cp 1"], runs["cp 2"]
    ratio = Spread.of(ratios([r["seconds"] for r in two], [r["seconds"] for r in one]))
    same = all(a["first"] == b["first"] for a, b in zip(one, two))
    print(f"cp2/cp1 time ratio {ratio.text()} (median of {ratio.n} rounds; min-max)")
    print(f"greedy first tokens identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
