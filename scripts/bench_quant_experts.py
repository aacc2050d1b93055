"""The routed experts of a decode step on FP4 / FP8 weights: one C call vs one expert at a time.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_quant_experts.py [--model /tmp/v4-160m] [--tokens 1 4 16 64]

The expert shapes (experts, top-k, hidden size, moe_intermediate_size) come from the model's
config.json (or --experts/--top-k/--hidden/--inter). For each token count it routes every token to
top-k distinct random experts, and times, alternating in every round: the experts on FP4 codes in
one call (`quant_experts.c`), the same through the per-expert path the cpu back end took before
(`CpuKernels.quantized_experts`: each expert's two products on the codes, `quant_gemv.c`, and torch's
swiglu), the FP8-block version of both, the FP4 one call on fp32 rows (the loops that decode to
fp32, where bf16 rows on an AVX512-BF16 CPU take vdpbf16ps on weights decoded to bf16), and the bf16
experts' one call (`experts_bf16`) for reference. It prints the median time per call and the speed
of each path against the per-expert one of its format (bf16: against FP4's).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.kernels import CpuKernels
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels


def expert_weights(E: int, out: int, inp: int, seed: int) -> dict[str, QuantizedWeight]:
    g = torch.Generator().manual_seed(seed)
    fp4 = torch.randint(0, 256, (E, out, inp // 2), generator=g, dtype=torch.uint8)
    fp4_scale = torch.randint(118, 125, (E, out, inp // 32), generator=g, dtype=torch.uint8)
    fp8 = torch.randint(0, 256, (E, out, inp), generator=g, dtype=torch.uint8)
    fp8[(fp8 & 0x7F) == 0x7F] = 0x7E
    fp8_scale = torch.randint(110, 125, (E, -(-out // 128), -(-inp // 128)), generator=g, dtype=torch.uint8)
    return {"fp4": QuantizedWeight(fp4, fp4_scale.view(torch.float8_e8m0fnu), 128, torch.bfloat16),
            "fp8": QuantizedWeight(fp8.view(torch.float8_e4m3fn), fp8_scale.view(torch.float8_e8m0fnu), 128,
                                   torch.bfloat16)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint folder whose config.json gives the shapes")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=50, help="calls timed per round and path")
    args = p.parse_args()
    if args.model:
        cfg = json.loads((Path(args.model) / "config.json").read_text())
        args.experts, args.top_k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
        args.hidden, args.inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    E, k, D, inter = args.experts, args.top_k, args.hidden, args.inter
    kernels = NativeCpuKernels()
    lib = kernels.native_library
    if lib is None:
        raise SystemExit("the cpu back end's C kernels are not available (see the warning above)")
    w13, w2 = expert_weights(E, 2 * inter, D, 0), expert_weights(E, D, inter, 1)
    b13, b2 = w13["fp4"].dequantize().contiguous(), w2["fp4"].dequantize().contiguous()
    limit = 10.0
    print(f"{E} experts of {2 * inter} x {D} and {D} x {inter}, top-{k}, {torch.get_num_threads()} threads, "
          f"tier {native.gemv_tier(lib)}")
    for tokens in args.tokens:
        g = torch.Generator().manual_seed(tokens)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
        rows, plan = kernels.moe_dispatch(torch.randn(tokens, D, generator=g).bfloat16(), ids, E)
        counts = plan.tokens_per_expert
        paths = {"bf16 one call": lambda: native.experts_bf16(lib, rows, counts, b13, b2, limit)}
        for kind in ("fp4", "fp8"):
            a, b = w13[kind], w2[kind]
            paths[f"{kind} per expert"] = lambda a=a, b=b: CpuKernels.quantized_experts(kernels, rows, plan, a, b,
                                                                                          limit)
            paths[f"{kind} one call"] = lambda a=a, b=b: native.quant_experts(lib, rows, counts, a, b, limit)
        # fp32 rows: the loops that decode to fp32 (AVX2 + FMA), where bf16 rows take vdpbf16ps on AVX512-BF16
        rows_f = rows.float()
        paths["fp4 one call, fp32 rows"] = lambda: native.quant_experts(lib, rows_f, counts, w13["fp4"], w2["fp4"],
                                                                        limit)
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, fn in paths.items():  # alternate the paths within every round
                fn()
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                times[name].append((time.perf_counter() - start) / args.calls)
        print(f"\n{tokens} tokens ({rows.shape[0]} rows, {int((counts > 0).sum())} experts with rows): "
              f"path, median us/call, speed vs the per-expert path of its format")
        for name, ts in times.items():
            base = statistics.median(times[name.split()[0] + " per expert"] if not name.startswith("bf16")
                                     else times["fp4 per expert"])
            t = statistics.median(ts)
            print(f"  {name:24s} {t * 1e6:9.1f}  {base / t:5.2f}x")


if __name__ == "__main__":
    main()
