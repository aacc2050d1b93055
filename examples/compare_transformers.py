"""deepinfer against transformers' `generate` on the same checkpoint and the same prompts.

    python examples/compare_transformers.py --model_name /tmp/v4-bench            # 32 x 256 in, 128 out
    python examples/compare_transformers.py --model_name /tmp/v4-bench --quick    # 4 x 64 in, 32 out

Both run in turn, never at the same time, after one untimed warm-up each, the side that goes first
alternating every pair (deepinfer, transformers; transformers, deepinfer; ...:
`deepinfer.benchmarks.timing`), so that drift and throttling hit both sides alike.
transformers runs in a child process: deepinfer's cpu back end changes process-wide settings (glibc
malloc keeps freed memory, see plugins/cpu/host_memory.py) that a user running transformers on its
own would not have. Each side runs
the whole batch greedily with every token forced to be generated (deepinfer `ignore_eos`,
transformers `min_new_tokens = max_new_tokens`); a run's output tokens/s = generated tokens / wall
time of the call (prefill included). Printed: both speeds per pair, and the ratio deepinfer /
transformers with min / median / max over the pairs.

All prompts have the same length: transformers' DeepSeek-V4 cannot left-pad its compressed layers
correctly, so padded batches would not be a fair (or correct) baseline. Only eager attention works
in transformers' V4.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from deepinfer.benchmarks.timing import Spread, alternating_rounds, ratios, timed
from deepinfer.benchmarks.transformers_baseline import ChildProcessSide, TransformersSide
from deepinfer.benchmarks.workloads import random_prompts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_name", default=None, help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--num_prompts", type=int, default=None, help="prompts per run (default 32; --quick 4)")
    p.add_argument("--input_len", type=int, default=None, help="tokens per prompt (default 256; --quick 64)")
    p.add_argument("--output_len", type=int, default=None, help="generated tokens per prompt (default 128; --quick 32)")
    p.add_argument("--pairs", type=int, default=3, help="timed (deepinfer, transformers) pairs (default 3)")
    p.add_argument("--quick", action="store_true", help="small sizes for a quick check")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    return p


def sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    defaults = (4, 64, 32) if args.quick else (32, 256, 128)
    values = tuple(v if v is not None else d for v, d in
                   zip((args.num_prompts, args.input_len, args.output_len), defaults))
    for name, v in zip(("--num_prompts", "--input_len", "--output_len"), values):
        if v < 1:
            raise ValueError(f"{name} {v} must be >= 1")
    if args.pairs < 1:
        raise ValueError(f"--pairs {args.pairs} must be >= 1")
    return values  # type: ignore[return-value]


class DeepinferSide:
    name = "deepinfer"

    def __init__(self, path: str, dtype: str, num_prompts: int, max_len: int):
        from deepinfer import LLM

        self.llm = LLM(model=path, dtype=dtype, max_num_seqs=num_prompts, max_model_len=max_len)

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        from deepinfer import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]


def tokens_per_second(side, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """Output tokens/s of one whole-batch call, and its tokens."""
    tokens, seconds = timed(lambda: side.generate(prompts, output_len))
    produced = sum(len(x) for x in tokens)
    if produced != len(prompts) * output_len:
        raise RuntimeError(f"{side.name} generated {produced} tokens, expected {len(prompts) * output_len}")
    return produced / seconds, tokens


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(prompts whose outputs are identical, mean common-prefix length)."""
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return sum(1 for x, y in zip(a, b) if x == y), statistics.mean(prefixes)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        num, input_len, output_len = sizes(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from deepinfer.models.deepseek_v4.checkpoint import parse_config, read_config
    from deepinfer.models.resolve import resolve_model

    path = str(resolve_model(args.model_name).path)
    model_type = read_config(path).get("model_type")
    if model_type != "deepseek_v4":
        print(f"error: {path} is a {model_type!r} checkpoint; transformers implements DeepSeek-V4 only "
              f"(DeepseekV4ForCausalLM): give --model_name a V4 checkpoint (deepinfer make-model DIR --size bench)",
              file=sys.stderr)
        return 2
    vocab = parse_config(read_config(path)).vocab_size
    prompts = random_prompts(num, input_len, vocab, seed=args.seed)
    # the warm-up has the timed batch's shapes (first-call allocation, kernel selection and oneDNN's
    # JIT compile of each new GEMM shape stay out of the timings, on both sides)
    warm = random_prompts(num, input_len, vocab, seed=args.seed + 1)
    print(f"model {path}, {args.dtype}, {num} prompts x {input_len} tokens -> {output_len} tokens, "
          f"{args.pairs} pairs, {torch.get_num_threads()} threads")

    ours = DeepinferSide(path, args.dtype, num, input_len + output_len)
    theirs = ChildProcessSide(TransformersSide, path, args.dtype)
    for side in (ours, theirs):  # untimed
        side.generate(warm, 2)

    last: dict[str, list[list[int]]] = {}  # each side's tokens of its latest run
    pair: dict[str, float] = {}

    def run(side):
        def measure(_case) -> float:
            speed, last[side.name] = tokens_per_second(side, prompts, output_len)
            return speed
        return measure

    def report(r: int, _case, name: str, speed: float) -> None:
        pair[name] = speed
        if len(pair) == 2:
            print(f"pair {r + 1}: deepinfer {pair['deepinfer']:,.1f} tok/s, transformers "
                  f"{pair['transformers']:,.1f} tok/s, ratio {pair['deepinfer'] / pair['transformers']:.2f}x",
                  flush=True)
            pair.clear()

    speeds = alternating_rounds({side.name: run(side) for side in (ours, theirs)}, args.pairs, on_sample=report)[None]
    spread = Spread.of(ratios(speeds["deepinfer"], speeds["transformers"]))
    print(f"output tokens/s ratio deepinfer / transformers over {spread.n} pairs: "
          f"median {spread.median:.2f}x (min {spread.low:.2f}x, max {spread.high:.2f}x)")
    same, prefix = agreement(last["deepinfer"], last["transformers"])
    print(f"greedy agreement (last pair): {same}/{num} outputs identical, mean common prefix "
          f"{prefix:.1f} of {output_len} tokens ({args.dtype}: rounding can flip near-ties)")
    ours.llm.shutdown()
    theirs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
