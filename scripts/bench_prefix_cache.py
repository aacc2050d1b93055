"""Measure the prefix cache on a multi-turn chat workload: cache on and off, alternating in one run.

    python scripts/bench_prefix_cache.py                         # embedded default model (bf16)
    python scripts/bench_prefix_cache.py --model DIR --conversations 8 --turns 6 --rounds 3

The workload: `--conversations` chats share a `--system_tokens` system prompt; each turn appends a
`--user_tokens` user message to the conversation so far (system prompt, earlier messages and the
model's earlier answers) and generates a `--answer_tokens` greedy answer. All conversations' turn
k run as one batch. Every round uses new random tokens, the same for both modes, so the cache-on
engine only reuses what the round itself left: the system prompt across conversations, and each
conversation's previous turns.

CPU timings drift (throttling, other processes), so the modes alternate round by round (the order
swaps every round, `deepinfer.benchmarks.timing`) and the report is the median (min-max) of the
per-round speed-ups off / on. It prints the cache's hit rate, the
share of prompt tokens it saved, and how many answers both modes agree on. A hit is exact, but a
prefill that starts at a cached block is a different chunk, and with the default kernels a chunk's
numbers move in the last bits with its length and batch; with a random-weight model near-ties
then flip some greedy tokens (bf16 most). `--batch_invariant` runs both modes with the
batch-invariant kernels, where a hit's logits are the same bits as a miss's: every answer must
agree (the exit status is 1 otherwise).
"""
from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys

from deepinfer.benchmarks.timing import Spread, alternating_rounds, ratios, timed


def conversations(seed: int, args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(seed)
    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]
    system = tokens(args.system_tokens)
    return system, [[tokens(args.user_tokens) for _ in range(args.turns)] for _ in range(args.conversations)]


def run_round(llm, seed: int, args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True)
    system, users = conversations(seed, args, llm.engine.vocab_size)
    history = [list(system) for _ in users]
    answers = []

    def conversation() -> None:
        for turn in range(args.turns):
            prompts = [h + u[turn] for h, u in zip(history, users)]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for i, o in enumerate(outs):
                answer = o.outputs[0].token_ids
                answers.append(answer)
                history[i] = prompts[i] + answer

    _, seconds = timed(conversation)
    return seconds, answers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system_tokens", type=int, default=1024)
    p.add_argument("--user_tokens", type=int, default=96)
    p.add_argument("--answer_tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--block_tokens", type=int, default=None, help="prefix cache block (default: the feature's)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--batch_invariant", action="store_true",
                   help="both modes on the batch-invariant kernels: answers must be identical")
    args = p.parse_args(argv)

    import torch

    from deepinfer import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    max_len = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens) + 1
    common = dict(model=args.model, dtype=args.dtype, max_model_len=max_len, max_num_seqs=args.conversations)
    table = {} if args.block_tokens is None else {"block_tokens": args.block_tokens}
    extra = {"batch_invariant": {}} if args.batch_invariant else {}
    engines = {"off": LLM(**common, features=extra), "on": LLM(**common, features={"prefix_cache": table, **extra})}
    # each mode's k-th run draws round k's conversations (seed 1000 + k), so both modes run the same ones
    seeds = {mode: itertools.count(1000) for mode in engines}

    def run_mode(mode: str):
        return lambda _case: run_round(engines[mode], seed=next(seeds[mode]), args=args)

    def report(r: int, _case, mode: str, result: tuple[float, list[list[int]]]) -> None:
        print(f"round {r}: {mode} {result[0]:.2f} s", flush=True)

    runs = alternating_rounds({mode: run_mode(mode) for mode in engines}, args.rounds, on_sample=report)[None]
    times = {mode: [seconds for seconds, _ in results] for mode, results in runs.items()}
    mismatches = sum(a != b for (_, off), (_, on) in zip(runs["off"], runs["on"]) for a, b in zip(off, on))
    stats = engines["on"].stats()["prefix_cache"]
    for llm in engines.values():
        llm.shutdown()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    speedup = Spread.of(ratios(times["off"], times["on"]))
    lookups = stats["hits"] + stats["misses"]
    print(f"model {engines['on'].build_info.model_path} ({engines['on'].build_info.dtype}"
          f"{', batch-invariant kernels' if args.batch_invariant else ''}), "
          f"{args.conversations} conversations x {args.turns} turns, system {args.system_tokens}, "
          f"user {args.user_tokens}, answer {args.answer_tokens} tokens, {args.rounds} rounds")
    print(f"hit rate {stats['hits']}/{lookups} = {stats['hits'] / max(lookups, 1):.1%}; prefill tokens saved "
          f"{stats['prefill_tokens_saved']}/{stats['prefill_tokens_total']} = "
          f"{stats['prefill_tokens_saved'] / max(stats['prefill_tokens_total'], 1):.1%}; "
          f"{stats['blocks']} blocks, {stats['bytes_used'] / 2**20:.1f} MiB, {stats['evictions']} evictions")
    print(f"median time per round: off {off:.2f} s, on {on:.2f} s, speed-up {speedup.text()} (per round; min-max)")
    total = args.rounds * args.conversations * args.turns
    print(f"answers identical in both modes: {total - mismatches}/{total}"
          + ("" if args.batch_invariant else " (default kernels: near-ties may flip; see --batch_invariant)"))
    return 1 if mismatches and args.batch_invariant else 0


if __name__ == "__main__":
    sys.exit(main())
