"""The decode products on the cpu back end with their packed weights on huge pages against 4 KB pages;
with --engine, whole batch-1 decode steps with and without huge pages.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_huge_pages.py [--shapes 129280x512] [--rows 1 16]
        [--rounds 16]
    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_huge_pages.py --engine MODEL [--rounds 5] [--tokens 256]

For each shape it packs one random bf16 weight (native.pack_bf16: on huge pages from 4 MB) and copies
the packed weight onto plain 4 KB pages, then times `packed_linear_bf16` on the two copies alternating
(the order flips every round), 20 calls per round each. A weight larger than the last-level cache is
read from memory at every call, as a decode step reads it. It prints the median time per call of
each and the median of the per-round ratios (4 KB / huge; above 1: huge pages faster), and how much
of the process's anonymous memory the kernel did back with huge pages (`AnonHugePages`).

With --engine, each round starts two processes one after the other (the order flips every round), one
with DEEPINFER_CPU_HUGE_PAGES=0 and one with the default: each builds an offline engine on MODEL (batch
1), generates a few tokens (the packed copies are made), then times two greedy generations of --tokens
tokens from a 128-token prompt: the step, the model's forward and its LM head (`_logits`: hc_head, the
final norm and the head's product). The LM head streams its 132 MB from memory at a speed this shared
machine's neighbours move, so the figure to read is the rest of the forward (the layers), whose weights,
cache and activations the two processes place differently.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from deepinfer_plugins.cpu import huge_pages, native


def anon_huge_mb() -> float:
    """Megabytes of this process's anonymous memory on huge pages (/proc/self/smaps_rollup)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    return 0.0


def engine_child(model: str, tokens: int) -> None:
    """One side of --engine: JSON of ms per decode step (the prompts' forwards included), per decode forward
    and per LM head in it, and AnonHugePages in MB."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

    llm = LLM(model=model, max_num_seqs=1, max_model_len=tokens + 256, async_pipeline=False)
    spent = {"forward": 0.0, "head": 0.0, "forwards": 0}
    forward, logits, decoding = llm.engine.model.forward, DeepseekV4ForCausalLM._logits, [False]

    def timed_forward(batch):  # decode forwards only (one new token): the prompt's forward is left out
        decoding[0] = batch.input_ids.numel() == 1
        t = time.perf_counter()
        out = forward(batch)
        if decoding[0]:
            spent["forward"] += time.perf_counter() - t
            spent["forwards"] += 1
        return out

    def timed_logits(*args):
        t = time.perf_counter()
        out = logits(*args)
        spent["head"] += (time.perf_counter() - t) if decoding[0] else 0.0
        return out

    llm.engine.model.forward = timed_forward
    DeepseekV4ForCausalLM._logits = timed_logits
    ids = torch.randint(0, 100_000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=4, **greedy), use_tqdm=False)  # packs
    spent.update(forward=0.0, head=0.0, forwards=0)
    t = time.perf_counter()
    for _ in range(2):
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=tokens, **greedy), use_tqdm=False)
    n = spent["forwards"]
    print(json.dumps({"step": (time.perf_counter() - t) / n * 1e3, "forward": spent["forward"] / n * 1e3,
                      "head": spent["head"] / n * 1e3, "anon_huge_mb": anon_huge_mb()}))


def engine_rounds(model: str, rounds: int, tokens: int) -> None:
    sides = {"huge": "1", "4 KB": "0"}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            env = dict(os.environ, DEEPINFER_CPU_HUGE_PAGES=sides[name], DEEPINFER_USE_NEXTN_DECODE="0")
            out = subprocess.run([sys.executable, __file__, "--engine-child", model, "--tokens", str(tokens)],
                                 env=env, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
        h, p = runs["huge"][-1], runs["4 KB"][-1]
        print(f"round {r + 1}: huge pages step {h['step']:.2f} ms (LM head {h['head']:.2f}, rest of the forward "
              f"{h['forward'] - h['head']:.2f}; AnonHugePages {h['anon_huge_mb']:.0f} MB), 4 KB step {p['step']:.2f} "
              f"(LM head {p['head']:.2f}, rest {p['forward'] - p['head']:.2f}; {p['anon_huge_mb']:.0f} MB)", flush=True)
    for what, key in (("step", lambda x: x["step"]), ("rest of the forward", lambda x: x["forward"] - x["head"])):
        ratios = [key(p) / key(h) for h, p in zip(runs["huge"], runs["4 KB"])]
        print(f"{what}: 4 KB / huge median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
              f"max {max(ratios):.3f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["129280x512"], help="N x K (out x in)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--calls", type=int, default=20, help="calls per side per round")
    p.add_argument("--engine", metavar="MODEL", help="whole batch-1 decode steps on this checkpoint instead")
    p.add_argument("--tokens", type=int, default=256, help="--engine: tokens per timed generation")
    p.add_argument("--engine-child", metavar="MODEL", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine_child:
        return engine_child(args.engine_child, args.tokens)
    if args.engine:
        return engine_rounds(args.engine, args.rounds, args.tokens)
    lib = native.active_library()
    if lib is None:
        raise SystemExit("the cpu back end's C kernels are not available (see the warning above)")
    if not huge_pages.enabled():
        raise SystemExit("DEEPINFER_CPU_HUGE_PAGES=0: nothing to compare")
    print(f"tier {native.gemv_tier(lib)}, {torch.get_num_threads()} threads")
    for N, K in [tuple(int(v) for v in s.split("x")) for s in args.shapes]:
        huge = native.pack_bf16(lib, torch.randn(N, K).bfloat16())
        plain = torch.empty(huge.shape, dtype=huge.dtype)
        plain.copy_(huge)
        print(f"{N}x{K}: {huge.numel() * 2 / 2**20:.0f} MB packed; process AnonHugePages {anon_huge_mb():.0f} MB")
        for M in args.rows:
            x = torch.randn(M, K).bfloat16()
            sides = {"huge": huge, "4 KB": plain}
            if not torch.equal(native.packed_linear_bf16(lib, x, huge, (N, K)),
                               native.packed_linear_bf16(lib, x, plain, (N, K))):
                raise SystemExit("the two copies gave different bits")
            times: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(args.rounds):
                for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        native.packed_linear_bf16(lib, x, sides[name], (N, K))
                    times[name].append((time.perf_counter() - t) / args.calls * 1e3)
            ratio = statistics.median(a / b for a, b in zip(times["4 KB"], times["huge"]))
            gb = huge.numel() * 2 / 1e9
            print(f"  M={M}: huge {statistics.median(times['huge']):.3f} ms "
                  f"({gb / statistics.median(times['huge']) * 1e3:.1f} GB/s), 4 KB "
                  f"{statistics.median(times['4 KB']):.3f} ms ({gb / statistics.median(times['4 KB']) * 1e3:.1f} GB/s); "
                  f"4 KB / huge {ratio:.3f} (min {min(a / b for a, b in zip(times['4 KB'], times['huge'])):.3f}, "
                  f"max {max(a / b for a, b in zip(times['4 KB'], times['huge'])):.3f})")


if __name__ == "__main__":
    main()
