"""Time and count the V4 step plan's work in a decode step, apart from the model.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step_plan.py --model DIR [--batch 1 16] [--context 150]
        [--clock wall|thread]

Builds the plans of 64 decode steps of `--batch` sequences (contexts from `--context`, one block table
per sequence) and asks each for what the V4 forward asks at decode: the attention groups, the entry
views of both compression rates, the ring writes of the window and compressor rings,
`positions % m` and the compression plans of the steps that complete windows. Prints the best of 7
passes per plan and the torch ops per plan (mean over the 64).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.models.batch import ForwardBatch
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.state import StepPlan, group_name, ring_sizes

BLOCK_SIZE, MAX_ROLLBACK = 64, 4


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def decode_batch(config: DeepseekV4Config, B: int, context: int) -> ForwardBatch:
    ctx = [context + 3 * i for i in range(B)]
    blocks = -(-(max(ctx) + 1) // BLOCK_SIZE)
    table = torch.arange(B * blocks).view(B, blocks)
    rates = (config.csa_compress_rate, config.hca_compress_rate)
    return ForwardBatch(input_ids=torch.zeros(B, dtype=torch.long), positions=torch.tensor(ctx), query_lens=[1] * B,
                        context_lens=ctx, slots=torch.arange(B), block_tables={group_name(r): table for r in rates},
                        logits_indices=torch.arange(B))


def plan_step(config: DeepseekV4Config, batch: ForwardBatch) -> StepPlan:
    rings = ring_sizes(config, MAX_ROLLBACK)
    plan = StepPlan(batch, config, rings, BLOCK_SIZE, num_slots=batch.num_seqs)
    _ = plan.groups
    for rate in (config.csa_compress_rate, config.hca_compress_rate):
        plan.entry_view(0, rate)
        plan.position_mod(rate)
    for ring in (rings.window, rings.csa_rows, rings.hca_rows):
        plan.ring_write(ring)
    for rate, ring, overlap in ((config.csa_compress_rate, rings.csa_rows, True),
                                (config.hca_compress_rate, rings.hca_rows, False)):
        if plan.windows_completed(rate):
            plan.compress_plan(rate, ring, overlap)
    return plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=150)
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="thread: the thread's CPU time (leaves out waits for a core on a loaded machine)")
    args = p.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    config = DeepseekV4Config.from_dict(json.loads((Path(args.model) / "config.json").read_text()))
    for B in args.batch:
        batches = [decode_batch(config, B, args.context + k) for k in range(64)]
        for b in batches[:8]:
            plan_step(config, b)
        best = float("inf")
        for _ in range(7):
            start = clock()
            for b in batches:
                plan_step(config, b)
            best = min(best, (clock() - start) / len(batches))
        with OpCount() as ops:
            for b in batches:
                plan_step(config, b)
        print(f"batch {B}: {best * 1e6:.1f} us per plan, {ops.count / len(batches):.1f} torch ops")


if __name__ == "__main__":
    main()
