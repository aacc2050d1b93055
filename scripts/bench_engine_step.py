"""Time the engine's own work in a decode step: everything but the model's forward.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_engine_step.py --model DIR [--batch 1] [--steps 300]

Builds the engine as the benchmark does (greedy, ignore_eos, sync mode unless --async_pipeline), then
replaces `model.forward` by a call that returns fixed random logits `[batch, vocab]`, so that a step
is the scheduler, the runner's `prepare`, the sampler (with `argmax_logsumexp` on logits that are
hot in cache), the output processing and the benchmark's own per-step trace
(`examples/bench/workloads.run_requests`). Prints the 10th percentile of each phase over the steps
(on a shared machine the low percentile is the phase's cost, the median its cost under load).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from bench import workloads  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.interface import ForwardOutput  # noqa: E402


def _timed(fn: Callable, into: list[float]) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)
    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--async_pipeline", action="store_true")
    args = p.parse_args()
    llm = LLM(model=args.model, max_num_seqs=args.batch, max_num_batched_tokens=4096,
              max_model_len=128 + args.steps + 8, async_pipeline=args.async_pipeline)
    engine = llm.engine
    vocab = engine.vocab_size
    logits = torch.randn(args.batch, vocab, generator=torch.Generator().manual_seed(0))
    engine.model.forward = lambda batch: ForwardOutput(logits=logits[:len(batch.logits_indices)], streams=None)
    phases: dict[str, list[float]] = {name: [] for name in
                                      ("step", "schedule", "prepare", "sampler", "argmax_logsumexp", "update")}
    engine.scheduler.schedule = _timed(engine.scheduler.schedule, phases["schedule"])
    engine.scheduler.update_from_output = _timed(engine.scheduler.update_from_output, phases["update"])
    engine.runner.prepare = _timed(engine.runner.prepare, phases["prepare"])
    engine.accelerator.argmax_logsumexp = _timed(engine.accelerator.argmax_logsumexp, phases["argmax_logsumexp"])
    engine.runner.sampler = _timed(engine.runner.sampler, phases["sampler"])
    engine.step = _timed(engine.step, phases["step"])

    prompts = workloads.random_prompts(args.batch, 128, vocab, seed=0)
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    workloads.run_requests(llm, prompts, params)  # warm-up
    for times in phases.values():
        times.clear()
    _, trace = workloads.run_requests(llm, prompts, params)
    loop = [b - a for a, b in zip(trace.ends, trace.ends[1:])]  # decode steps (the first one prefills)

    def p10(values: list[float]) -> str:
        return f"{statistics.quantiles(values, n=10)[0] * 1e6:.1f}"

    print(f"batch {args.batch}, {len(loop)} decode steps, 10th percentile in us: benchmark loop step {p10(loop)}, "
          + ", ".join(f"{name} {p10(times[1:])}" for name, times in phases.items()))
    llm.shutdown()


if __name__ == "__main__":
    main()
