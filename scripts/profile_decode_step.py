"""Where the time of a decode step goes: per-kernel time and op counts of the model's decode forwards.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/profile_decode_step.py --model DIR [--batch 1] [--steps 64]
        [--ops]

Runs `--batch` prompts of 128 tokens through the offline engine, then `--steps` decode steps, and
reports for the forwards whose every sequence has one new token (decode steps only):
- the wall time per forward of each accelerator kernel and each V4 model op (exclusive: a kernel
  called inside another counts for itself), the LM head's product apart from the other linears,
  and the model's own code between them ("glue" of the model, attention, MoE, compressor and step
  plan functions);
- with `--ops`, then the torch ops per forward by the source function that issued them (a second
  run of the steps under a TorchDispatchMode, which slows every op).
Time spent in the engine outside the forward (scheduling, sampling) is printed too. One thread
gives the steadiest figures on a shared machine.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deepinfer
import deepinfer_plugins
from deepinfer import LLM, SamplingParams
from deepinfer.models.deepseek_v4 import attention, compressor, moe, state
from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

# accelerator kernels and V4 ops timed on their own
KERNELS = ("rms_norm", "rotary", "hc_pre", "hc_post", "hc_head", "swiglu", "sink_attention", "grouped_linear",
           "moe_route", "moe_dispatch", "moe_experts", "moe_combine", "indexer_topk", "compress_pool",
           "argmax_logsumexp", "moe_sublayer", "rms_norm_rotary", "sink_attention_rows", "attention_projections",
           "decode_attention_output")
# model code whose own time (outside the kernels above) is its glue
GLUE = ((attention.Attention, "forward"), (moe.MoE, "forward"), (compressor.Compressor, "update"),
        (state.StepPlan, "__init__"), (state.StepPlan, "_group"), (state.StepPlan, "entry_view"),
        (state.StepPlan, "compress_plan"), (DeepseekV4ForCausalLM, "forward"))


class ExclusiveTimer:
    """Wall time per name, each call's nested timed calls subtracted; on only while `active`."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self._inner = [0.0]
        self.active = False

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            self._inner.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[name] += elapsed - self._inner.pop()
                self._inner[-1] += elapsed
        return timed


class OpSites(TorchDispatchMode):
    """Counts torch ops by the first frame of this repository's code that issued them."""

    def __init__(self, roots: tuple[str, ...]):
        super().__init__()
        self.roots, self.sites = roots, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.startswith(self.roots):
            frame = frame.f_back
        site = "?" if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
        self.sites[site] += 1
        return func(*args, **(kwargs or {}))


def instrument(llm: LLM, timer: ExclusiveTimer) -> None:
    accel = llm.engine.accelerator
    linear = accel.linear
    lm_head = timer.wrap("linear: LM head", linear)
    layers = timer.wrap("linear: layers", linear)
    vocab = llm.engine.vocab_size
    accel.linear = lambda x, w: (lm_head if w.shape[0] == vocab else layers)(x, w)
    for name in KERNELS:
        setattr(accel, name, timer.wrap(name, getattr(accel, name)))
    ops = llm.engine.model.ops  # the model's V4 op table (its methods may call the kernels above)
    for name in ("hc_pre", "hc_pre_norm", "hc_post", "hc_post_pre_norm", "hc_head", "compress_store", "compress_pool",
                 "indexer_topk", "decode_block"):
        setattr(ops, name, timer.wrap(name, getattr(ops, name)))
    for cls, name in GLUE:
        setattr(cls, name, timer.wrap(f"{cls.__name__}.{name} (glue)", getattr(cls, name)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--ops", action="store_true", help="also count torch ops per forward by source function")
    args = p.parse_args()
    llm = LLM(model=args.model, max_num_seqs=args.batch, max_num_batched_tokens=4096, max_model_len=512)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 120_000, (128,), generator=g).tolist()}
               for _ in range(args.batch)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, args.steps + 1)]
    llm.generate(prompts, params[0], use_tqdm=False)  # warm-up: kernels built, weights packed

    timer, counts = ExclusiveTimer(), {"forwards": 0, "seconds": 0.0}
    instrument(llm, timer)
    sites = OpSites(tuple(os.path.dirname(m.__file__) for m in (deepinfer, deepinfer_plugins)))
    model = llm.engine.model
    forward, mode = model.forward, {"ops": False}

    def measured(batch):
        if not all(int(n) == 1 for n in batch.query_lens):
            return forward(batch)
        if mode["ops"]:
            with sites:
                return forward(batch)
        timer.active = True
        start = time.perf_counter()
        try:
            return forward(batch)
        finally:
            counts["seconds"] += time.perf_counter() - start
            counts["forwards"] += 1
            timer.active = False

    model.forward = measured
    start = time.perf_counter()
    llm.generate(prompts, params[1], use_tqdm=False)
    total = time.perf_counter() - start
    n = counts["forwards"]
    print(f"{n} decode forwards, batch {args.batch}, {torch.get_num_threads()} threads: "
          f"{counts['seconds'] / n * 1e3:.2f} ms per forward; the whole generate (prefill included) "
          f"{total / n * 1e3:.2f} ms per decode step")
    for name, seconds in timer.seconds.most_common():
        print(f"{seconds / n * 1e3:9.3f} ms  {name}")
    if args.ops:
        mode["ops"] = True
        llm.generate(prompts, params[1], use_tqdm=False)
        print(f"torch ops per decode forward: {sum(sites.sites.values()) / n:.0f}, by source function:")
        for site, count in sites.sites.most_common(30):
            print(f"{count / n:9.1f}  {site}")


if __name__ == "__main__":
    main()
