"""The engine's decode (or prefill) with the packed C tiles (native/packed_gemm.c) on and off in ONE process, alternating
run by run, so that both sides see the same machine load (a shared machine makes separate processes'
figures swing ten-fold). "off" routes the linears as before the tiles: the one-token GEMV, the C
multi-token GEMV up to its tier's rows, oneDNN-packed weights (or torch's F.linear) above.

    OMP_NUM_THREADS=2 DEEPINFER_USE_NEXTN_DECODE=0 .venv/bin/python scripts/ab_packed_tiles.py \\
        --pairs 4 -- --preset cpu --model_name /tmp/v4-160m --phase decode --decode_num_requests 16 \\
        --context_length 128 --decode_tokens 64 --dtype bfloat16

Everything after `--` goes to examples/benchmark.py (its --repeats is set here; one phase, decode or
prefill). Prints each run's tokens/s and the per-pair ratios on/off.
"""
from __future__ import annotations

import argparse
import runpy
import statistics
import sys
from pathlib import Path

from deepinfer_plugins.cpu import native_kernels

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--warm", type=int, default=2, help="untimed runs first, off/on in turn (even; prefill: 4, "
                   "as a weight is packed at its second use and a prefill run uses each weight once)")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then examples/benchmark.py's arguments")
    args = p.parse_args()
    bench = [a for a in args.bench if a != "--"]
    state = {"on": False}
    rows = native_kernels._PACKED_GEMM_ROWS
    # a data descriptor: wins over the instance's cached value
    native_kernels.NativeCpuKernels._packed_gemm_rows = property(
        lambda self: rows[native_kernels.native.gemv_tier(self.native_library)] if state["on"] else (0, 0))
    sys.path.insert(0, str(ROOT / "examples"))
    from bench import workloads
    results, runs = {True: [], False: []}, [0]

    def alternate(run):
        return lambda *a, **k: alternating(run, *a, **k)

    def alternating(run, *a, **k):
        # the warm-up runs (off: its oneDNN copies get packed; on: the tiles' copies), then off/on pairs
        index = runs[0]
        runs[0] += 1
        state["on"] = index % 2 == 1
        out = run(*a, **k)
        if index >= args.warm:
            tokens = getattr(out, "accepted_tokens", None) or out.tokens  # decode, prefill
            results[state["on"]].append(tokens / out.seconds)
            print(f"run {index}: tiles {'on ' if state['on'] else 'off'} {results[state['on']][-1]:.1f} tok/s",
                  flush=True)
        return out

    workloads.run_decode, workloads.run_prefill = alternate(workloads.run_decode), alternate(workloads.run_prefill)
    sys.argv = [str(ROOT / "examples" / "benchmark.py"), *bench, "--repeats", str(2 * args.pairs + args.warm)]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exit_:
        if exit_.code:
            raise
    ratios = [a / b for a, b in zip(results[True], results[False])]
    print(f"tiles on/off per pair: {', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x; "
          f"on {statistics.median(results[True]):.1f} tok/s, off {statistics.median(results[False]):.1f} tok/s")


if __name__ == "__main__":
    main()
