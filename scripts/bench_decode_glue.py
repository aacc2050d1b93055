"""The V4 model's glue in one decode forward: its thread CPU time outside the accelerator kernels.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_decode_glue.py --model DIR [--batch 1] [--prompt 150]
        [--runs 300]

Prefills `--batch` prompts of `--prompt` tokens, captures the first decode step's batch and runs that
forward `--runs` times (the state rewritten with the same values each time). Prints quartiles of the
forward's thread CPU time minus that of the outermost accelerator kernels and V4 ops it calls: the
model's own Python and torch-op work. Thread CPU time leaves out the time the process waits for a core,
so the figure stays usable on a loaded machine (compare two trees in turn, as ratios). `--prompt`
decides whether the step completes compression windows (e.g. 151: the CSA windows of rate 4 complete).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from deepinfer import LLM, SamplingParams

KERNELS = ("linear", "rms_norm", "rotary", "hc_pre", "hc_post", "hc_head", "swiglu", "sink_attention",
           "grouped_linear", "moe_route", "moe_dispatch", "moe_experts", "moe_combine", "indexer_topk",
           "compress_pool", "argmax_logsumexp", "moe_sublayer", "rms_norm_rotary", "sink_attention_rows",
           "attention_projections", "decode_attention_output")
V4_OPS = ("hc_pre", "hc_pre_norm", "hc_post", "hc_head", "compress_store", "compress_pool", "indexer_topk")


class KernelClock:
    """Thread CPU time inside the outermost wrapped calls (a kernel calling another counts once)."""

    def __init__(self) -> None:
        self.inside, self._depth = 0.0, 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth, start = 1, time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside += time.thread_time() - start
                self._depth = 0
        return timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=150, help="prompt tokens (the decode step's context length)")
    p.add_argument("--runs", type=int, default=300)
    args = p.parse_args()
    llm = LLM(model=args.model, max_num_seqs=args.batch, max_num_batched_tokens=4096,
              max_model_len=max(512, args.prompt + 16))
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 120_000, (args.prompt,), generator=g).tolist()}
               for _ in range(args.batch)]
    model = llm.engine.model
    forward, captured = model.forward, []

    def capture(batch):
        if not captured and all(int(n) == 1 for n in batch.query_lens):
            captured.append(batch)
        return forward(batch)

    model.forward = capture
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    model.forward = forward
    batch = captured[0]
    clock, accel = KernelClock(), llm.engine.accelerator
    for name in KERNELS:
        setattr(accel, name, clock.wrap(getattr(accel, name)))
    for name in V4_OPS:
        setattr(model.ops, name, clock.wrap(getattr(model.ops, name)))
    for _ in range(20):  # warm-up
        forward(batch)
    glue = []
    for _ in range(args.runs):
        clock.inside = 0.0
        start = time.thread_time()
        forward(batch)
        glue.append(time.thread_time() - start - clock.inside)
    glue.sort()

    def q(p: float) -> float:
        return glue[int(p * (len(glue) - 1))] * 1e3

    print(f"batch {args.batch}, context {batch.context_lens[0]}, {torch.get_num_threads()} threads: glue per "
          f"decode forward min {q(0):.3f} p25 {q(0.25):.3f} median {q(0.5):.3f} ms")


if __name__ == "__main__":
    main()
