"""`deepinfer generate`: run prompts through the offline engine and print the completions.

    deepinfer generate --prompt "The capital of France is" --max-tokens 16 --temperature 0
    deepinfer generate --model /path/to/checkpoint --prompt "a" --prompt "b" --json
    echo "from stdin" | deepinfer generate --prompt -

Without --model: DEEPINFER_HF_MODEL_DIR, else deepseek-ai/DeepSeek-V4.1-Flash-1017 if the local
Hugging Face cache holds it, else the embedded default model (the small demo DeepSeek-V4.1 trained on
Shakespeare; the command says so). Engine settings not exposed as flags go in a TOML file (--config).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer generate", description="Generate text from prompts (offline).")
    p.add_argument("--model", default=None, help="checkpoint directory or Hugging Face id in the local cache")
    p.add_argument("--prompt", action="append", default=[],
                   help="prompt text (repeat for several; '-' reads one prompt from standard input)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed (seq_seed)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--accelerator", default=None, help="back end (default: DEEPINFER_ACCELERATOR, else auto)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--sampler-force-topk", type=int, default=None)
    p.add_argument("--no-async", action="store_true", help="disable the async batch pipeline")
    p.add_argument("--config", default=None, help="TOML engine configuration file")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prompts = [sys.stdin.read().removesuffix("\n") if p == "-" else p for p in args.prompt]
    if not prompts:
        parser.error("give at least one --prompt TEXT (or --prompt - to read it from standard input)")

    from deepinfer.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seq_seed=args.seed,
                                stop=args.stop, ignore_eos=args.ignore_eos)
    except ValueError as e:
        parser.error(str(e))

    from deepinfer.llm import LLM

    try:
        llm = LLM(model=args.model, accelerator=args.accelerator, dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, sampler_force_topk=args.sampler_force_topk, config=args.config,
                  async_pipeline=False if args.no_async else None)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if llm.build_info.is_default_model:
        print(f"[using the embedded default model (the small demo model trained on Shakespeare) at {llm.build_info.model_path}; "
              f"pass --model for a real checkpoint]", file=sys.stderr if args.json else sys.stdout)
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    except KeyboardInterrupt:
        # Leave at once: a forward already running on the worker thread cannot be stopped
        # mid-kernel, and waiting for it is not what Ctrl-C asks for.
        print("interrupted", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    elapsed = time.perf_counter() - start
    status = 0
    for out in outputs:
        c = out.outputs[0]
        if out.error is not None and c.finish_reason == "error":
            status = 1
        if args.json:
            print(json.dumps({"request_id": out.request_id, "prompt": out.prompt, "text": c.text,
                              "token_ids": c.token_ids, "finish_reason": c.finish_reason, "error": out.error,
                              "decode_ppl": out.metrics.decode_ppl, "num_prompt_tokens": out.metrics.num_prompt_tokens}))
            continue
        print(c.text if out.error is None else f"error: {out.error}")
        ppl = "n/a" if out.metrics.decode_ppl is None else f"{out.metrics.decode_ppl:.3f}"
        print(f"[finish_reason={c.finish_reason}; output_tokens={len(c.token_ids)}; decode_ppl={ppl}]")
    if not args.json:
        total = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"[{len(outputs)} prompt(s), {total} tokens in {elapsed:.2f} s]", file=sys.stderr)
    llm.shutdown()
    return status
