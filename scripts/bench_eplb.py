"""Expert-parallel load imbalance with and without EPLB, on a skewed workload (cpu back end, gloo).

    .venv/bin/python scripts/bench_eplb.py                  # --ep 2, 32 experts, 4 of them hot
    .venv/bin/python scripts/bench_eplb.py --ep 4 --extra 8 --hot 2

Builds a small random DeepSeek-V4 checkpoint (32 routed experts, top-4, every MoE layer scored)
whose router biases favour `--hot` experts (ids 0…hot−1, so under the contiguous placement they
all sit on rank 0), then runs the same greedy generation twice on `--ep` ranks (`--dp` = ep):
once with EPLB off (what `--disable_eplb` does) and once with it on. Each run has a warm-up pass
(in which EPLB sees the load and re-places the experts), then a measured pass. Printed per run:
rows served per EP rank in the measured pass, their max/mean (`imbalance`), and the per-exchange
max/mean weighted by rows (`exchange imbalance`: how much the busiest rank stretches each MoE
exchange). 1.0 is perfect balance. The counts are the EP group's own (`ExpertParallel.track_load`).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = ["The capital of France is", "1 2 3 4 5 6 7 8", "a b a b a b", "Once upon a time",
           "def main():", "Hello, world", "The quick brown fox", "x y z x y z"]


def skewed_checkpoint(out: Path, hot: int, bias: float, layers: int) -> str:
    from safetensors.torch import load_file, save_file

    from deepinfer.models.deepseek_v4.make_model import make_model

    path = make_model(out, "tiny", seed=0, with_mtp=False, num_hidden_layers=layers, n_routed_experts=32,
                      num_experts_per_tok=4, mlp_layer_types=("moe",) * layers)
    files = sorted(path.glob("*.safetensors"))
    for file in files:
        tensors = load_file(file)
        for name, t in tensors.items():
            if name.endswith("gate.e_score_correction_bias") or name.endswith("gate.bias"):
                t[:hot] += bias  # the selection adds the bias: these experts win most top-k slots
        save_file(tensors, file, metadata={"format": "pt"})
    return str(path)


def run_rank(ctx, checkpoint: str, features: dict, max_tokens: int) -> dict:
    from deepinfer import LLM
    from deepinfer.parallel.expert_parallel import current_expert_parallel, idle_until_peers_done
    from deepinfer.sampling_params import SamplingParams

    layout = ctx.layout
    llm = LLM(model=checkpoint, accelerator="cpu", dtype="float32", max_num_seqs=4, cache_memory_gb=0.1,
              features=features, ep=layout.ep, dp=layout.dp, cp=layout.cp)
    load = current_expert_parallel().track_load()
    mine = [p for i, p in enumerate(PROMPTS) if i % layout.dp == ctx.dp_rank]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * len(mine)
    llm.generate(mine, params, use_tqdm=False)  # warm-up: EPLB sees the load and re-places
    idle_until_peers_done()  # every rank leaves in the same exchange: the snapshots below agree
    rows, peak = load.rank_rows.clone(), load.peak_rows
    start = time.perf_counter()
    outs = llm.generate(mine, params, use_tqdm=False)
    idle_until_peers_done()
    seconds = time.perf_counter() - start
    rows, peak = load.rank_rows - rows, load.peak_rows - peak
    llm.shutdown()
    return {"rows": rows.tolist(), "peak": peak, "seconds": seconds,
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def measure(checkpoint: str, ep: int, features: dict, max_tokens: int, threads: int) -> dict:
    from deepinfer.parallel.launch import launch
    from deepinfer.parallel.layout import ParallelLayout
    from deepinfer.plugins import load_accelerator_class

    results = launch(run_rank, (checkpoint, features, max_tokens), ParallelLayout(ep=ep, dp=ep),
                     load_accelerator_class("cpu"), threads_per_rank=threads)
    rows = torch.tensor(results[0]["rows"], dtype=torch.float64)
    mean = rows.mean().item()
    return {"rows": results[0]["rows"], "imbalance": rows.max().item() / mean,
            "exchange_imbalance": results[0]["peak"] / mean, "seconds": results[0]["seconds"],
            "tokens": [t for r in results for t in r["tokens"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--extra", type=int, default=8, help="redundant experts (DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS)")
    parser.add_argument("--hot", type=int, default=4, help="experts the router biases favour")
    parser.add_argument("--bias", type=float, default=0.6, help="router bias added to the hot experts")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max_tokens", type=int, default=16)
    parser.add_argument("--interval", type=int, default=8, help="EPLB rebalance interval (forward passes)")
    parser.add_argument("--threads_per_rank", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = skewed_checkpoint(Path(tmp) / "skewed", args.hot, args.bias, args.layers)
        off = measure(checkpoint, args.ep, {"eplb": {"enabled": False}}, args.max_tokens, args.threads_per_rank)
        on = measure(checkpoint, args.ep, {"eplb": {"num_extra_experts": args.extra,
                                                    "rebalance_interval": args.interval}},
                     args.max_tokens, args.threads_per_rank)
    same = sorted(off.pop("tokens")) == sorted(on.pop("tokens"))
    if args.json:
        print(json.dumps({"args": vars(args), "off": off, "on": on, "same_tokens": same}))
    else:
        print(f"ep={args.ep}, 32 experts top-4, {args.hot} hot (bias +{args.bias}), {args.layers} MoE layers, "
              f"extra={args.extra}, rebalance every {args.interval} passes")
        for name, r in (("EPLB off", off), ("EPLB on", on)):
            print(f"{name:9s} rows per rank {r['rows']}  imbalance {r['imbalance']:.3f}  "
                  f"exchange imbalance {r['exchange_imbalance']:.3f}  ({r['seconds']:.1f} s)")
        print(f"greedy tokens identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
