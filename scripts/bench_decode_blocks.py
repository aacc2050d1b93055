"""Batch-1 decode steps with a one-token step's decoder blocks as their prepared C calls (the default)
against the same blocks run module by module (DEEPINFER_CPU_DECODE_BLOCKS=0), one process per side and
round, the order flipping every round (engine_ab.py).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_decode_blocks.py MODEL [--rounds 6] [--tokens 256]

Each side prints its ms per decode step, the LM head's share and the rest of the forward (the blocks,
where the two sides differ); the summary is the median of the per-round ratios modules / blocks (above 1:
the prepared calls are faster). With DEEPINFER_CPU_QUANTIZED_WEIGHTS=1 in the environment both sides keep
the checkpoint's FP8 / FP4 weights quantised.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_ab import engine_rounds  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a DeepSeek-V4 checkpoint directory")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=256, help="tokens per timed generation")
    args = p.parse_args()
    engine_rounds(args.model, args.rounds, args.tokens, "DEEPINFER_CPU_DECODE_BLOCKS", {"blocks": "1", "modules": "0"})


if __name__ == "__main__":
    main()
