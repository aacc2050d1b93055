"""Throughput with the batch_invariant feature on vs off, alternating in one run (cpu back end).

    .venv/bin/python scripts/bench_batch_invariant.py [--model DIR] [--size tiny] [--family v4]
        [--requests 16] [--max-tokens 32] [--rounds 2]

Each round builds one engine with the feature off and one with it on (in alternating order) and
times `generate` of the same requests (prompts of 3..3+5*(n-1) tokens, greedy); prints prefill +
decode tokens per second of each, and the on/off ratio of the medians.
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from deepinfer import LLM
from deepinfer.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="checkpoint directory (default: a random --family/--size one in a temp folder)")
    p.add_argument("--family", default="v4", choices=("v4", "v41"))
    p.add_argument("--size", default="tiny")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    model = args.model
    if model is None:
        if args.family == "v4":
            from deepinfer.models.deepseek_v4.make_model import make_model
        else:
            from deepinfer.models.deepseek_v41.make_model import make_model
        model = str(make_model(Path(tempfile.mkdtemp()) / "model", args.size, seed=0))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(3 + 5 * i)] for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tokens = sum(map(len, prompts)) + args.requests * args.max_tokens
    rates: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            llm = LLM(model=model, accelerator="cpu", dtype="bfloat16", max_model_len=512,
                      max_num_seqs=args.max_num_seqs, features={"batch_invariant": {"enabled": on}})
            llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            rates[on].append(tokens / (time.perf_counter() - t0))
            llm.shutdown()
            print(f"round {r} batch_invariant={'on ' if on else 'off'} {rates[on][-1]:8.1f} tokens/s", flush=True)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"median: off {off:.1f} tokens/s, on {on:.1f} tokens/s, on/off = {on / off:.2f}")


if __name__ == "__main__":
    main()
