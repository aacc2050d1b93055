"""Structured-output costs on the real DeepSeek-V4 vocabulary (129,280 tokens).

Prints, as markdown tables:
1. compile time per constraint (parse at admission + token-mask compilation in the pool), cache off;
2. per-step bitmask fill (`StructuredOutputProcessor.fill_bitmask`: xgrammar fill + control-token
   blocking + dead-end check) and mask application at batch 1 and 32, measured along real
   constrained generations (random logits, temperature 1), for the back end's
   `apply_token_bitmask` kernel and, side by side, xgrammar's own CPU kernel.

With `--end_to_end CHECKPOINT` it instead measures the end-to-end cost through `LLM.generate`:
decode tokens/s of constrained requests against unconstrained ones that run exactly the same
steps (see `bench_end_to_end`), alternating A/B in one engine, plus where the time went.

Run: python examples/structured_output_bench.py [--runs 5] [--batches 1 32] [--threads N]
     python examples/structured_output_bench.py --end_to_end /tmp/bm/bench [--pairs 3] [--batches 1 32]
CPU figures are noisy (a shared 2-core machine): compare the two kernels as a ratio within one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from types import SimpleNamespace

import torch

import _structured_output as samples  # examples/

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


E2E_CONSTRAINTS = ("json free strings", "regex (seed)")


class _Timer:
    """Wraps a bound method on one object and records the seconds of each call (any thread)."""

    def __init__(self, owner: object, name: str):
        self.durations: list[float] = []
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.durations.append(time.perf_counter() - t0)

        setattr(owner, name, timed)

    def take(self) -> list[float]:
        durations, self.durations = self.durations, []
        return durations


def _decode_window(outputs) -> tuple[int, float]:
    """(decode tokens, decode seconds): tokens after each request's first one, over the time from
    the last first token (the prefill step) to the last finish."""
    tokens = sum(max(len(o.outputs[0].token_ids) - 1, 0) for o in outputs)
    start = max(o.metrics.first_token_time for o in outputs)
    end = max(o.metrics.finished_time for o in outputs)
    return tokens, end - start


def bench_end_to_end(model: str, batches: list[int], pairs: int, prompt_tokens: int, max_tokens: int) -> None:
    """Constrained (A) against unconstrained (B) decoding on one engine, speculation off.

    A: `batch` requests with the constraint, greedy, `max_tokens`, EOS allowed (a constraint ends
    on EOS). B: the same prompts, unconstrained, greedy, `ignore_eos=True`, and for each request
    `max_tokens` = the number of tokens its A twin produced in the first A run, so both sides run
    the same steps with the same batch shape (greedy A is deterministic, checked on every run).
    Decode tokens/s = tokens after the first one / (last finish - first token); the prefill step,
    identical on both sides, is left out. Fill, apply and forward are timed per call by wrapping
    the processor's `fill_bitmask`, the accelerator's `apply_token_bitmask` and the model's
    `forward`: fill and apply are the mean per call (one per step, the prefill's sampling included),
    forward the mean over the decode steps. Fill runs on the engine thread while the forward runs;
    apply is on the critical path, so "apply / B step" is the slowdown the mask kernel alone explains.
    """
    import os
    import random

    from deepinfer import LLM, SamplingParams

    # Speculation off: no dspark table, and DEEPINFER_USE_NEXTN_DECODE (which alone turns it on)
    # unset while the engine is built, then restored for the caller.
    biggest = max(batches)
    nextn = os.environ.pop("DEEPINFER_USE_NEXTN_DECODE", None)
    try:
        llm = LLM(model=model, max_num_seqs=biggest, max_model_len=prompt_tokens + max_tokens + 8,
                  max_num_batched_tokens=max(prompt_tokens * biggest, 256))
    finally:
        if nextn is not None:
            os.environ["DEEPINFER_USE_NEXTN_DECODE"] = nextn
    engine = llm.engine
    if engine.speculator is not None:
        llm.shutdown()
        raise RuntimeError("speculative decoding is on; run without the dspark feature")
    vocab = engine.vocab_size
    forward = _Timer(engine.runner.model, "forward")
    apply = _Timer(engine.runner.sampler.accelerator, "apply_token_bitmask")
    fills = [_Timer(p, "fill_bitmask") for p in engine.processors]
    print(f"model {model}, vocabulary {vocab}, torch threads {torch.get_num_threads()}, async pipeline "
          f"{llm.config.async_pipeline}, speculation off, prompts {prompt_tokens} tokens, max_tokens {max_tokens}, "
          f"{pairs} A/B pairs")
    llm.generate([[5] * prompt_tokens], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    print("\n| constraint | batch | decode steps | A tok/s | B tok/s | A/B tok/s median (min-max) "
          "| A per step: fill / apply / forward / total (ms) | B per step: forward / total (ms) | apply / B step |"
          "\n|---|---|---|---|---|---|---|---|---|")
    for name in E2E_CONSTRAINTS:
        so_args = CONSTRAINTS[name]
        for batch in batches:
            rng = random.Random(batch)
            prompts = [[rng.randrange(3, min(vocab, 128000)) for _ in range(prompt_tokens)] for _ in range(batch)]
            constrained = SamplingParams(temperature=0, max_tokens=max_tokens, so_args=so_args)
            lengths: list[int] | None = None
            samples: dict[str, list[dict]] = {"A": [], "B": []}
            for run in range(pairs + 1):  # run 0 warms up (grammar compile, cache) and fixes the lengths
                for side in ("AB" if run % 2 else "BA") if lengths else "A":
                    if side == "A":
                        params = constrained
                    else:
                        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
                    forward.take(), apply.take(), [f.take() for f in fills]
                    outputs = llm.generate(prompts, params, use_tqdm=False)
                    got = [len(o.outputs[0].token_ids) for o in outputs]
                    if side == "A" and lengths is None:
                        lengths = got
                        continue
                    if got != lengths:
                        raise RuntimeError(f"{side} produced lengths {got}, expected {lengths}")
                    tokens, seconds = _decode_window(outputs)
                    fill = [d for f in fills for d in f.take()]
                    samples[side].append({"tps": tokens / seconds, "forward": statistics.mean(forward.take()[1:]),
                                          "apply": statistics.mean(apply.take() or [0.0]),
                                          "fill": statistics.mean(fill or [0.0]), "step": seconds / (max(got) - 1)})
            steps = max(lengths) - 1
            ratios = sorted(a["tps"] / b["tps"] for a, b in zip(samples["A"], samples["B"]))
            med = {side: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for side, runs in samples.items()}
            a, b = med["A"], med["B"]
            ms = lambda v: f"{1e3 * v:.1f}"  # noqa: E731
            print(f"| {name} | {batch} | {steps} | {a['tps']:.1f} | {b['tps']:.1f} | "
                  f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}) | "
                  f"{ms(a['fill'])} / {ms(a['apply'])} / {ms(a['forward'])} / {ms(a['step'])} | "
                  f"{ms(b['forward'])} / {ms(b['step'])} | {100 * a['apply'] / b['step']:.1f}% |", flush=True)
    llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="compilations per constraint (median)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--end_to_end", metavar="CHECKPOINT", default=None,
                        help="measure constrained vs unconstrained decoding through LLM.generate on this checkpoint")
    parser.add_argument("--pairs", type=int, default=3, help="--end_to_end: A/B pairs per constraint and batch")
    parser.add_argument("--prompt_tokens", type=int, default=32, help="--end_to_end: prompt length")
    parser.add_argument("--max_tokens", type=int, default=32, help="--end_to_end: max_tokens of the constrained side")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.end_to_end:
        bench_end_to_end(args.end_to_end, args.batches, args.pairs, args.prompt_tokens, args.max_tokens)
        return 0

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
