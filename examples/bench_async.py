"""Measure the async batch pipeline: the same workload with it on and off, alternating in one run.

    python examples/bench_async.py                      # embedded default model, 8 sequences
    python examples/bench_async.py --structured         # regex / JSON / EBNF requests (grammar bitmasks)
    python examples/bench_async.py --model_name DIR --num_seqs 16 --max_tokens 64 --rounds 5

What the pipeline hides is the host's share of a step: scheduling, building the batch, applying the
previous step's tokens (stop checks, detokenization) and filling logits-processor bitmasks. With
plain sampling that share is small next to a CPU forward, so expect a ratio near 1; grammar
bitmasks (--structured) are host work the pipeline overlaps with the forward.

CPU timings drift (throttling after ~25 s of load, other processes), so the two modes alternate
round by round and the report is the ratio of medians, not absolute speed. It also checks that
both modes produced identical tokens.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name", default=None, help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--num_seqs", type=int, default=8)
    p.add_argument("--prompt_tokens", type=int, default=16)
    p.add_argument("--max_tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's); 1 leaves a core to the engine thread")
    p.add_argument("--structured", action="store_true",
                   help="use the structured-output samples (regex, JSON schema, EBNF) for every sequence")
    args = p.parse_args(argv)

    import torch

    from deepinfer import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)

    engines = {mode: LLM(model=args.model_name, dtype=args.dtype, async_pipeline=mode, max_num_seqs=args.num_seqs,
                         max_model_len=args.prompt_tokens + args.max_tokens + 64, sampler_force_topk=4096)
               for mode in (False, True)}
    vocab = engines[False].engine.vocab_size
    if args.structured:
        from _structured_output import SAMPLES

        prompts = [SAMPLES[i % len(SAMPLES)][0] for i in range(args.num_seqs)]
        params = [SamplingParams(temperature=0.7, max_tokens=args.max_tokens, seq_seed=i,
                                 so_args=dict(SAMPLES[i % len(SAMPLES)][1])) for i in range(args.num_seqs)]
    else:
        prompts = [[(7919 * (i + 1) + 31 * j) % (vocab - 10) + 5 for j in range(args.prompt_tokens)]
                   for i in range(args.num_seqs)]
        params = [SamplingParams(temperature=0.7, max_tokens=args.max_tokens, seq_seed=i, ignore_eos=True)
                  for i in range(args.num_seqs)]
    for llm in engines.values():  # warm-up
        llm.generate(prompts, params, use_tqdm=False)

    times: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list[list[int]]] = {}
    for llm in engines.values():
        llm.engine.step_seconds = llm.engine.wait_seconds = 0.0
    for r in range(args.rounds):
        for mode in ((False, True) if r % 2 == 0 else (True, False)):
            start = time.perf_counter()
            outs = engines[mode].generate(prompts, params, use_tqdm=False)
            times[mode].append(time.perf_counter() - start)
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
    sync_engine = engines[False].engine
    host = sync_engine.step_seconds - sync_engine.wait_seconds  # what the pipeline can hide
    identical = tokens[False] == tokens[True]
    n = sum(len(t) for t in tokens[True])
    sync_t, async_t = statistics.median(times[False]), statistics.median(times[True])
    kind = "structured-output" if args.structured else "plain"
    print(f"workload: {args.num_seqs} {kind} sequences, {n} tokens per run, {args.rounds} rounds per mode, "
          f"{torch.get_num_threads()} torch threads")
    print(f"async off: median {sync_t:.3f} s ({n / sync_t:.1f} tok/s)   rounds {[round(t, 3) for t in times[False]]}")
    print(f"async on : median {async_t:.3f} s ({n / async_t:.1f} tok/s)   rounds {[round(t, 3) for t in times[True]]}")
    print(f"host share of a step with async off: {host / sync_engine.step_seconds:.1%} "
          f"(scheduling, batch building, applying tokens, bitmasks; the most overlap can hide: "
          f"a {1 / (1 - host / sync_engine.step_seconds):.3f}x ceiling)")
    print(f"speed-up (off / on): {sync_t / async_t:.3f}x; outputs identical: {identical}")
    for llm in engines.values():
        llm.shutdown()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
