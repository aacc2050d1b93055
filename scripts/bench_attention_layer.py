"""The attention sub-layer of a one-token decode step on the cpu back end with its weights kept quantised:
the composed path (the interface's attention_projections and decode_attention_output defaults: a kernel
call each) against the back end's two fused C calls (attention_layer.c on the FP8 / FP4 codes).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_attention_layer.py [--format fp8] [--wo-a bf16]
        [--entries 16] [--rounds 200]

The defaults are the 161 M V4 checkpoint's attention as DEEPINFER_CPU_QUANTIZED_WEIGHTS=1 loads it (hidden
512, 4 heads of 128, q rank 128, 2 output groups of rank 64; fused_x [256, 512], fused_qr [512, 128] and
wo_b [512, 128] FP8 blocks of 128, wo_a bf16: its 64-row groups are not whole blocks), a window of 32
keys and `--entries` compressed ones. The paths alternate in every round (every other round in
reverse); the median time per call of each and their ratio are printed, and the two checked for the
same bits.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer.accelerator.interface import Accelerator
from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels


def quantised(w: torch.Tensor, kind: str, block: int) -> torch.Tensor | QuantizedWeight:
    """w `[out, in]` as FP8 blocks (e4m3 codes, ue8m0 block scales), FP4 (e2m1, ue8m0 per 32) or bf16."""
    if kind == "bf16":
        return w.bfloat16()
    if kind == "fp8":
        o, i = w.shape
        blocks = w.reshape(o // block, block, i // block, block).abs().amax(dim=(1, 3))
        exps = torch.ceil(torch.log2(blocks.clamp(min=1e-30) / 448)).clamp(-127, 127)
        scaled = w / torch.repeat_interleave(torch.repeat_interleave(2.0 ** exps, block, 0), block, 1)
        return QuantizedWeight(scaled.to(torch.float8_e4m3fn), (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu),
                               block, torch.bfloat16)
    o, i = w.shape
    groups = w.reshape(o, i // 32, 32)
    exps = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)
    values = (groups / (2.0 ** exps).unsqueeze(-1)).reshape(o, i)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    codes = (values.abs().unsqueeze(-1) - grid).abs().argmin(-1) | ((values < 0).int() << 3)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return QuantizedWeight(packed, (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu), 32, torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", choices=("fp8", "fp4", "bf16"), default="fp8", help="fused_x, fused_qr and wo_b")
    p.add_argument("--wo-a", choices=("fp8", "fp4", "bf16"), default="bf16")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--entries", type=int, default=16, help="compressed keys (0: a sliding layer)")
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args()
    kernels = NativeCpuKernels()
    lib = kernels.native_library
    if lib is None:
        raise SystemExit("the cpu back end's C kernels are not available (see the warning above)")
    print(f"tier {native.gemv_tier(lib)}, {torch.get_num_threads()} threads")
    g = torch.Generator().manual_seed(0)
    D, H, d, rank, G, R, half, window = 512, 4, 128, 128, 2, 64, 32, 32

    def weight(o: int, i: int, kind: str) -> torch.Tensor | QuantizedWeight:
        return quantised(torch.randn(o, i, generator=g) / i ** 0.5, kind, args.block)
    fused_x, fused_qr = weight(2 * rank, D, args.format), weight(H * d, rank, args.format)
    wo_b = weight(D, G * R, args.format)
    wo_a = weight(G * R, H * d // G, args.wo_a)
    wo_a = wo_a.unflatten_rows(G) if isinstance(wo_a, QuantizedWeight) else wo_a.view(G, R, -1)
    q_norm, kv_norm = torch.rand(rank, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    angles = torch.randn(1, half, generator=g)
    cos, sin = angles.cos(), angles.sin()
    x = torch.randn(1, D, generator=g).bfloat16()
    projections = (x, fused_x, rank, q_norm, fused_qr, H, kv_norm, 1e-6, cos, sin, 0, None, None)
    caches = [torch.randn(window, d, generator=g).bfloat16()]
    rows = [torch.arange(window).view(1, -1)]
    masks = [torch.ones(1, 1, window, dtype=torch.bool)]
    if args.entries:
        caches.append(torch.randn(4 * args.entries, d, generator=g).bfloat16())
        rows.append(torch.randperm(4 * args.entries, generator=g)[:args.entries].view(1, -1))
        masks.append(torch.ones(1, 1, args.entries, dtype=torch.bool))
    q, kv = torch.randn(1, H, d, generator=g).bfloat16(), torch.randn(1, d, generator=g).bfloat16()
    output = (q, kv, torch.tensor([3]), tuple(caches), tuple(rows), tuple(masks), torch.randn(H, generator=g),
              d ** -0.5, cos, sin, wo_a, wo_b)
    for _ in range(2):  # any packed copies the composed path makes at a weight's second use
        Accelerator.attention_projections(kernels, *projections)
        Accelerator.decode_attention_output(kernels, *output)
    paths = {
        "composed": lambda: (Accelerator.attention_projections(kernels, *projections),
                             Accelerator.decode_attention_output(kernels, *output)),
        "fused": lambda: (kernels.attention_projections(*projections), kernels.decode_attention_output(*output)),
    }
    got, want = paths["fused"](), paths["composed"]()
    same = all(torch.equal(a, b) for a, b in zip((*got[0][:3], got[1]), (*want[0][:3], want[1])))
    times: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(args.rounds):
        for name, fn in (list(paths.items()) if r % 2 == 0 else list(paths.items())[::-1]):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    composed, fused = (statistics.median(times[n]) for n in ("composed", "fused"))
    print(f"weights {args.format} (wo_a {args.wo_a}), {args.entries} entries: composed {composed * 1e6:.1f} us, "
          f"fused {fused * 1e6:.1f} us per layer (composed / fused {composed / fused:.2f}x); same bits: {same}")


if __name__ == "__main__":
    main()
