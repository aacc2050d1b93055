"""Structured-output costs on the real DeepSeek-V4 vocabulary (129,280 tokens).

Prints, as markdown tables:
1. compile time per constraint (parse at admission + token-mask compilation in the pool), cache off;
2. per-step bitmask fill (`StructuredOutputProcessor.fill_bitmask`: xgrammar fill + control-token
   blocking + dead-end check) and mask application at batch 1 and 32, measured along real
   constrained generations (random logits, temperature 1), for the back end's
   `apply_token_bitmask` kernel and, side by side, xgrammar's own CPU kernel.

Run: python examples/structured_output_bench.py [--runs 5] [--batches 1 32] [--threads N]
CPU figures are noisy (machine.md §3): compare the two kernels as a ratio within one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _structured_output as samples  # noqa: E402

FREE_STRING_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
                      "required": ["title", "body"]}
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "pos": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                                 "ok": {"type": "boolean"}}, "required": ["x", "ok"]},
    },
    "required": ["name", "tags", "pos"],
}
CONSTRAINTS = {
    "regex (seed)": {"schema_type": "regex", "schema": samples.SAMPLES[0][1]["schema"]},
    "json (seed)": {"schema_type": "json", "schema": samples.SAMPLES[1][1]["schema"]},
    "ebnf (seed)": {"schema_type": "ebnf", "schema": samples.SAMPLES[2][1]["schema"]},
    "json nested": {"schema_type": "json", "schema": json.dumps(NESTED_SCHEMA)},
    "json free strings": {"schema_type": "json", "schema": json.dumps(FREE_STRING_SCHEMA)},
}


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.3f}"


def bench_compile(vocabulary, runs: int) -> None:
    from deepinfer_plugins.features.structured_output.config import StructuredOutputConfig
    from deepinfer_plugins.features.structured_output.grammar import Constraint, GrammarCompiler

    compiler = GrammarCompiler(vocabulary, StructuredOutputConfig(cache_size=0))
    compiler._start()
    print("\n| constraint | parse at admission (ms) | compile in the pool (ms) |\n|---|---|---|")
    for name, so_args in CONSTRAINTS.items():
        constraint = Constraint.from_so_args(so_args)
        parse, compile_ = [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            grammar = compiler.parse(constraint)
            t1 = time.perf_counter()
            compiler._compiler.compile_grammar(grammar)
            t2 = time.perf_counter()
            parse.append(t1 - t0)
            compile_.append(t2 - t1)
        print(f"| {name} | {median_ms(parse)} | {median_ms(compile_)} |")
    compiler.shutdown()


def bench_steps(vocabulary, batch: int, max_steps: int = 48) -> None:
    import xgrammar as xgr

    from deepinfer_plugins.cpu import CpuAccelerator
    from deepinfer_plugins.features.structured_output.processor import StructuredOutputProcessor

    accelerator = CpuAccelerator()
    for name, so_args in CONSTRAINTS.items():
        proc = StructuredOutputProcessor(vocabulary)
        ids = [f"{name}-{i}" for i in range(batch)]
        for rid in ids:
            proc.add_request(rid, SimpleNamespace(so_args=so_args))
        gen = torch.Generator().manual_seed(0)
        fill, ours, theirs = [], [], []
        active = list(ids)
        for _ in range(max_steps):
            if not active:
                break
            bitmask = torch.full((len(active), vocabulary.bitmask_width), -1, dtype=torch.int32)
            t0 = time.perf_counter()
            proc.fill_bitmask(active, bitmask)
            fill.append(time.perf_counter() - t0)
            logits = torch.rand(len(active), vocabulary.vocab_size, generator=gen)
            reference = logits.clone()
            if len(ours) % 2:  # alternate the order so neither kernel always runs second
                t0 = time.perf_counter()
                accelerator.apply_token_bitmask(logits, bitmask)
                ours.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                xgr.apply_token_bitmask_inplace(reference, bitmask, vocab_size=vocabulary.vocab_size, backend="cpu")
                theirs.append(time.perf_counter() - t0)
            else:
                t0 = time.perf_counter()
                xgr.apply_token_bitmask_inplace(reference, bitmask, vocab_size=vocabulary.vocab_size, backend="cpu")
                theirs.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                accelerator.apply_token_bitmask(logits, bitmask)
                ours.append(time.perf_counter() - t0)
            if not torch.equal(logits, reference):
                raise AssertionError("the back end's apply_token_bitmask disagrees with xgrammar's")
            sampled = logits.argmax(dim=-1).tolist()
            active = [rid for rid, token in zip(active, sampled) if not proc.accept(rid, [token])]
        proc.shutdown()
        ratio = statistics.median(theirs) / statistics.median(ours)
        print(f"| {name} | {batch} | {len(fill)} | {median_ms(fill)} | {median_ms(ours)} | {median_ms(theirs)} | "
              f"{ratio:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="compilations per constraint (median)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from deepinfer.tokenizer import Tokenizer, default_tokenizer_path
    from deepinfer_plugins.features.structured_output.grammar import tokenizer_info
    from deepinfer_plugins.features.structured_output.vocabulary import vocabulary_from_tokenizer

    tokenizer = Tokenizer.from_file(default_tokenizer_path())
    t0 = time.perf_counter()
    vocabulary = vocabulary_from_tokenizer(tokenizer, tokenizer.vocab_size)
    t1 = time.perf_counter()
    import xgrammar  # noqa: F401
    t2 = time.perf_counter()
    tokenizer_info(vocabulary)
    t3 = time.perf_counter()
    print(f"torch threads: {torch.get_num_threads()}; vocabulary: {vocabulary.vocab_size} ids, "
          f"{len(vocabulary.blocked_token_ids)} blocked")
    print(f"one-off costs at the first constrained request: vocabulary {1e3 * (t1 - t0):.0f} ms, "
          f"import xgrammar {1e3 * (t2 - t1):.0f} ms, TokenizerInfo {1e3 * (t3 - t2):.0f} ms")
    bench_compile(vocabulary, args.runs)
    print("\n| constraint | batch | steps | fill per step (ms) | apply, back end (ms) | apply, xgrammar cpu (ms) "
          "| xgrammar / back end |\n|---|---|---|---|---|---|---|")
    for batch in args.batches:
        bench_steps(vocabulary, batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
