"""The MoE sub-layer of a bf16 decode batch on the cpu back end: the composed path (router, top-k,
dispatch, expert kernel, combine and shared expert, a call each) against the fused C call
(moe_layer.c) with its routed experts on the multi-token GEMVs and on the packed register tiles.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_moe_layer.py [--tokens 4 8 16 64] [--layers 6]
        [--experts 16] [--top-k 4] [--hidden 512] [--inter 128] [--shared-inter 128]
        [--baseline /path/to/other/checkout]

The defaults are the 161 M V4 checkpoint's MoE (16 experts of 256 x 512 and 512 x 128, top-4, one
128-wide shared expert, 6 layers). `--layers` sets of weights are cycled, a call per layer, as a
decode step does; the paths alternate in every round and the median time per call is printed with
each path's ratio to the fused call on the tiles. The packed copies are made before timing (the
back end makes them at a weight's second use). `--baseline` adds the fused call on the tiles of the C
kernels built from another checkout's sources (baseline_library.py), in the same process, and checks
that both give the same bits.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.kernels import CpuKernels
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels


def layer_weights(T: int, D: int, E: int, I: int, SI: int, g: torch.Generator) -> tuple:
    """x, gate, bias, hash ids, w13, w2, shared w13, shared w2 of one MoE layer (as moe_sublayer takes them)."""
    def bf16(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / fan_in ** 0.5).bfloat16()
    return (torch.randn(T, D, generator=g).bfloat16(), torch.randn(E, D, generator=g) / D ** 0.5,
            torch.randn(E, generator=g) * 0.1, None, bf16(E, 2 * I, D, fan_in=D), bf16(E, D, I, fan_in=I),
            bf16(2 * SI, D, fan_in=D), bf16(D, SI, fan_in=SI))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4, 8, 16, 64])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--shared-inter", type=int, default=128)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--baseline", help="root of another checkout: also time its fused call on the tiles")
    args = p.parse_args()
    kernels = NativeCpuKernels()
    lib = kernels.native_library
    if lib is None:
        raise SystemExit("the cpu back end's C kernels are not available (see the warning above)")
    print(f"tier {native.gemv_tier(lib)}, {torch.get_num_threads()} threads")
    base_lib = None
    if args.baseline:
        from baseline_library import baseline_library
        base_lib = baseline_library(args.baseline)
    g = torch.Generator().manual_seed(0)
    layers = [layer_weights(max(args.tokens), args.hidden, args.experts, args.inter, args.shared_inter, g)
              for _ in range(args.layers)]
    packed = [tuple(native.pack_bf16(lib, w) for w in layer[4:]) for layer in layers]
    tiles, (low, high) = kernels.tile_weights, kernels._packed_gemm_rows
    for layer in layers:  # the composed path's linears find the shared expert's packed copies
        for _ in range(2):
            for w in layer[6:]:
                tiles is not None and tiles.lookup(w)
    route = (args.top_k, 1.5, "sqrtsoftplus", 10.0)
    for T in args.tokens:
        def composed(i: int) -> torch.Tensor:
            x, *rest = layers[i]
            return CpuKernels.moe_sublayer(kernels, x[:T], *rest, *route)

        def fused(i: int, on_tiles: bool, library=lib) -> torch.Tensor:
            x, *rest = layers[i]
            pw13, pw2, psw13, psw2 = packed[i]
            return native.moe_layer_bf16(library, x[:T], *rest, *route, T * args.shared_inter < 4096,
                                         packed_experts=(pw13, pw2) if on_tiles else None,
                                         packed_shared=(psw13, psw2) if low <= T <= high else None)
        paths = {"composed": composed, "fused, GEMV experts": lambda i: fused(i, False),
                 "fused, tiles": lambda i: fused(i, True)}
        if base_lib is not None:
            paths["baseline fused, tiles"] = lambda i: fused(i, True, base_lib)
            if not all(torch.equal(fused(i, True), fused(i, True, base_lib)) for i in range(args.layers)):
                print(f"{T} tokens: the baseline's fused call gives other bits")
        times: dict[str, list[float]] = {name: [] for name in paths}
        for r in range(args.rounds):  # every other round in reverse: no path always follows another
            for name, fn in (list(paths.items()) if r % 2 == 0 else list(paths.items())[::-1]):
                t0 = time.perf_counter()
                for i in range(args.layers):
                    fn(i)
                times[name].append((time.perf_counter() - t0) / args.layers)
        base = statistics.median(times["fused, tiles"])
        print(f"{T} tokens: " + ", ".join(f"{name} {statistics.median(v) * 1e6:.0f} us "
                                          f"({statistics.median(v) / base:.2f}x)" for name, v in times.items()))


if __name__ == "__main__":
    main()
