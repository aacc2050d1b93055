"""decode_attention_output's C call (attention_output_bf16) and its stages for one decode token, on the C kernels
built for AVX-512 and for the AVX2 tier in ONE process, alternating (a shared machine makes separate processes'
figures swing):

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_attention_output.py [--heads 4] [--baseline /path/to/checkout]
        [--rounds 30]

The shapes are the 161 M V4 checkpoint's (head_dim 128, 2 output groups of rank 64, hidden 512, a 32-key window
and 16 compressed entries) with `--heads` query heads, six layers' weights cycled. Each build is compiled into a
temporary folder from this checkout's sources (the AVX2 one with DEEPINFER_CPU_NATIVE_ISA=no-avx512's flags);
`--baseline` adds the AVX2 build of another checkout's sources (baseline_library.py) and checks that it gives
this checkout's AVX2 bits. Prints the median time per call of each build and its median ratio to AVX-512's.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.native import build

LAYERS = 6


def _library(folder: Path, variant: str, sources: Path | None = None):
    """The kernels compiled with `variant`'s flags (from `sources`' C files when given) into `folder`."""
    saved = build.SOURCES, build.HEADERS
    if sources is not None:  # its own headers: one this checkout added is not included by its sources
        build.SOURCES = tuple(sources / p.name for p in saved[0])
        build.HEADERS = tuple(sources / p.name for p in saved[1] if (sources / p.name).is_file())
    try:
        path = folder / f"kernels-{variant}-{'baseline' if sources else 'here'}.so"
        native._compile(path, native._compiler(), native.build_flags(variant))
        return native._load(path)
    finally:
        build.SOURCES, build.HEADERS = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--baseline", help="root of another checkout: also time its AVX2 build")
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp())
    libs = {"avx512": _library(folder, "native"), "avx2": _library(folder, "no-avx512")}
    if args.baseline:
        libs["baseline avx2"] = _library(folder, "no-avx512",
                                         Path(args.baseline).expanduser().resolve() / "plugins" / "cpu" / "native")
    g = torch.Generator().manual_seed(0)
    H, d, G, R, D = args.heads, 128, 2, 64, 512

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).bfloat16()

    q, kv, window, entries, att, x = rand(1, H, d), rand(1, d), rand(64, d), rand(40, d), rand(1, H, d), rand(G * R)
    rows = (torch.arange(32).view(1, 32), torch.randperm(40, generator=g)[:16].view(1, 16))
    masks = (torch.ones(1, 1, 32, dtype=torch.bool), torch.ones(1, 1, 16, dtype=torch.bool))
    sinks, angles = torch.randn(H, generator=g), torch.randn(1, 32, generator=g)
    wo_a = [rand(G, R, H * d // G) * 0.05 for _ in range(LAYERS)]
    wo_b = [rand(D, G * R) * 0.05 for _ in range(LAYERS)]
    paths = {
        "attention_output_bf16": lambda lib, i: native.attention_output_bf16(
            lib, q, kv, torch.tensor([5]), (window, entries), rows, masks, sinks, 0.08, angles.cos(), angles.sin(),
            wo_a[i], wo_b[i], None, None),
        "sink_attention_rows": lambda lib, i: native.sink_attention_rows(lib, q.view(1, 1, H, d), (window, entries),
                                                                         rows, masks, sinks, 0.08),
        "grouped_gemv_bf16 (wo_a)": lambda lib, i: native.grouped_gemv_bf16(lib, att.view(1, G, -1), wo_a[i]),
        "gemv_bf16 (wo_b)": lambda lib, i: native.gemv_bf16(lib, wo_b[i], x),
    }
    print(f"{torch.get_num_threads()} threads, {H} heads")
    for name, fn in paths.items():
        if "baseline avx2" in libs and not all(torch.equal(fn(libs["avx2"], i), fn(libs["baseline avx2"], i))
                                               for i in range(LAYERS)):
            print(f"{name}: the baseline's AVX2 build gives other bits")
        times: dict[str, list[float]] = {k: [] for k in libs}
        for r in range(args.rounds):  # every other round in reverse: no build always follows another
            for k in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                t0 = time.perf_counter()
                for c in range(4 * LAYERS):
                    fn(libs[k], c % LAYERS)
                times[k].append((time.perf_counter() - t0) / (4 * LAYERS))
        base = times["avx512"]
        print(f"{name}: " + "; ".join(
            f"{k} {statistics.median(ts) * 1e6:.1f} us ({statistics.median(t / b for t, b in zip(ts, base)):.2f}x)"
            for k, ts in times.items()))


if __name__ == "__main__":
    main()
