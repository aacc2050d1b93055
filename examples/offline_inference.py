"""Offline batch inference over the sample prompts (the seeds' examples/offline_inference.py).

    python examples/offline_inference.py                       # embedded default model, CPU: seconds
    python examples/offline_inference.py --model_name /path/to/checkpoint
    python examples/offline_inference.py --check_structured_output
    python examples/offline_inference.py --long_context        # 16,389 input + 4,096 output tokens each
                                                               # (refused up front on a shorter model)
    python examples/offline_inference.py --greedy --dtype float32   # what tests/models' PPL baselines record

Samples: four text prompts, and two image prompts (examples/images/lighthouse.jpeg and shapes.png,
pictures drawn by examples/images/draw_images.py) when the model reads images: a DeepSeek-V4.1
checkpoint with its vision tower (`deepinfer make-model --family v41 --vision` writes a random one;
the embedded default model has one, untrained). On any other model the image samples are skipped
with one note on stderr that says why; so are they with --long_context.

For each sample it prints one line:

    DP <rank>; INPUT: ...; OUTPUT: ...; output_tokens=...; accept_rate=...; decode_ppl=...

accept_rate is the share of speculative draft tokens accepted (n/a without speculative decoding);
decode_ppl is the perplexity of the model over its generated tokens.

Model: --model_name (a checkpoint directory, or a Hugging Face id already in the local cache);
without it DEEPINFER_HF_MODEL_DIR, else deepseek-ai/DeepSeek-V4.1-Flash-1017 if the local Hugging
Face cache holds it, else the embedded default model (a small DeepSeek-V4.1 trained on Shakespeare, expanded
on first use). Parallelism: --ep/--dp/--cp follow the seeds' rules (see _launch.py and
docs/parallelism.md): one process per rank; the samples are dealt round-robin over the DP ranks
and printed in their original order (on several nodes node 0 prints every rank's samples, the
other nodes only their ranks' summaries on stderr); the ranks of a CP group share each sample's prefill and
must print the same lines (checked). --cp splits long prefills of DeepSeek-V4 and V4.1 checkpoints (a
model family that cannot is refused before any process starts). --dtype float32 runs the model in fp32
(to compare layouts).

Speculative decoding: the seeds' default DEEPINFER_USE_NEXTN_DECODE=5 is applied when the dspark
feature is installed, unless the model's family cannot draft yet (DeepSeek-V4.1: its DSpark head
is not supported); then the example says so on stderr and runs without speculation. Setting
DEEPINFER_USE_NEXTN_DECODE yourself always wins (a value > 0 on such a model is an error).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

from _launch import (REFUSALS, ParallelConfigError, ParallelSizes, RankContext, RankFailed,  # examples/
                     check_context_parallel_model, error_line, launch_dp, resolve_parallel)
from _prompts import (LONG_CONTEXT_INPUT_TOKENS, LONG_CONTEXT_OUTPUT_TOKENS, image_samples_note,  # examples/
                      prepare_image_prompts, prepare_offline_prompts)
from _speculation import drafter_unsupported, speculation_off_note  # examples/

# Engine settings baked into the example (as in the seeds). max_model_len is left to the engine's
# default, min(the model's limit, 32768): 32768 for DeepSeek-V4 checkpoints, less for tiny test models.
MAX_MODEL_LEN = None
MAX_NUM_BATCHED_TOKENS = 32768
MAX_NUM_SEQS = 4
GPU_MEMORY_UTILIZATION = 0.85
INPUT_DISPLAY_CHARS = 200


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DeepInfer offline batch inference over sample prompts.")
    parser.add_argument("--model_name", default=None,
                        help="checkpoint directory or Hugging Face id in the local cache (default: "
                             "DEEPINFER_HF_MODEL_DIR, else deepseek-ai/DeepSeek-V4.1-Flash-1017 if the local "
                             "Hugging Face cache holds it, else the embedded default model)")
    parser.add_argument("--ep", type=int, default=None,
                        help="expert-parallel size (default: 8 on an accelerator node, 1 on the CPU back end)")
    parser.add_argument("--dp", type=int, default=None, help="data-parallel size (default: ep // cp, at least 1)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    parser.add_argument("--threads_per_rank", type=int, default=None,
                        help="CPU threads of each rank's process (default: cores // ranks on this node)")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                        help="compute dtype (default: the checkpoint's); float32 to compare layouts exactly")
    parser.add_argument("--long_context", action="store_true",
                        help="16,389 input tokens and 4,096 output tokens per sample")
    parser.add_argument("--long_context_input_tokens", type=int, default=LONG_CONTEXT_INPUT_TOKENS,
                        help=f"input tokens per sample with --long_context (default {LONG_CONTEXT_INPUT_TOKENS:,})")
    parser.add_argument("--long_context_output_tokens", type=int, default=LONG_CONTEXT_OUTPUT_TOKENS,
                        help=f"output tokens per sample with --long_context (default {LONG_CONTEXT_OUTPUT_TOKENS:,})")
    parser.add_argument("--greedy", action="store_true",
                        help="decode every sample greedily (temperature 0), as the perplexity baselines in "
                             "tests/models/offline_decode_ppl.json do")
    parser.add_argument("--check_structured_output", action="store_true",
                        help="also run regex / JSON-schema / EBNF samples and fail if an output violates its "
                             "constraint or does not end on EOS")
    parser.add_argument("--sampler_force_topk", type=int, default=4096,
                        help="restrict sampling to the top-k logits first (default 4096)")
    parser.add_argument("--disable_eplb", action="store_true",
                        help="turn off expert-parallel load balancing (the eplb feature: redundant hot experts, "
                             "re-placed periodically; on by default with the seeds' 32 extra experts; nothing to "
                             "balance with --ep 1)")
    args = parser.parse_args(argv)
    if args.sampler_force_topk < 1:
        parser.error(f"--sampler_force_topk {args.sampler_force_topk} must be >= 1")
    for flag in ("long_context_input_tokens", "long_context_output_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)} must be >= 1")
    return args


_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def one_line(text: str | None, limit: int | None = None) -> str:
    """Keep each sample on one output line: escape newlines and other control or line-separator
    characters (backslash-escaped), shorten very long inputs."""
    text = "".join(_ESCAPES.get(ch) or (ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii"))
                   for ch in (text or ""))
    if limit is not None and len(text) > limit:
        text = text[:limit] + f"...[{len(text) - limit} more chars]"
    return text


def format_result(rank: int, prompt_text: str | None, output) -> str:
    completion = output.outputs[0]
    metrics = output.metrics
    accept = "n/a" if metrics.accept_rate is None else f"{metrics.accept_rate:.3f}"
    ppl = "n/a" if metrics.decode_ppl is None else f"{metrics.decode_ppl:.3f}"
    shown_output = completion.text if output.error is None else f"[{completion.finish_reason}: {output.error}]"
    return (f"DP {rank}; INPUT: {one_line(prompt_text, INPUT_DISPLAY_CHARS)}; OUTPUT: {one_line(shown_output)}; "
            f"output_tokens={len(completion.token_ids)}; accept_rate={accept}; decode_ppl={ppl}")


def check_long_context(model_name: str | None, input_tokens: int = LONG_CONTEXT_INPUT_TOKENS,
                       output_tokens: int = LONG_CONTEXT_OUTPUT_TOKENS) -> None:
    """Refuse --long_context before any process starts when the model cannot hold one sample's
    prompt and output (the engine would fail every sample alone); ValueError with the fix. A model
    that cannot be resolved here is left to the engine, which reports that in its own words."""
    from deepinfer.engine.builder import DEFAULT_MAX_MODEL_LEN
    from deepinfer.models.registry import checkpoint_family
    from deepinfer.models.resolve import resolve_model

    try:
        path = resolve_model(model_name).path
        family, raw = checkpoint_family(path)
        limit = family.parse_config(raw, str(path / "config.json")).max_position_embeddings
    except (OSError, ValueError, RuntimeError):
        return
    usable = MAX_MODEL_LEN or min(limit, DEFAULT_MAX_MODEL_LEN)
    needed = input_tokens + output_tokens
    if needed > usable:
        raise ValueError(f"--long_context needs {needed:,} tokens per sample ({input_tokens:,} prompt + "
                         f"{output_tokens:,} output), but the model at {path} holds {usable:,} "
                         f"(max_position_embeddings {limit:,}); use a checkpoint with a longer context (--model_name), "
                         f"fewer tokens (--long_context_input_tokens / --long_context_output_tokens) "
                         f"or run without --long_context")


def accelerator_name() -> str:
    from deepinfer.plugins import select_accelerator_class

    return select_accelerator_class(None).name


#: The seeds' environment defaults, applied (before the engine reads the environment) only when
#: the feature they configure is installed and the user has not set the variable.
SEED_ENV_DEFAULTS = [  # (variable, value, feature, accelerators it applies to or None for all)
    ("DEEPINFER_USE_NEXTN_DECODE", "5", "dspark", None),
    ("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "32", "eplb", None),
    ("DEEPINFER_BATCH_INVARIANT", "1", "batch_invariant", ("nvidia",)),
]


def apply_seed_env_defaults(accelerator: str, disable_eplb: bool,
                            cannot_draft: Callable[[], str | None] | None = None,
                            declares_batch_invariant: Callable[[], bool] | None = None) -> dict[str, str]:
    """Set the seeds' defaults whose variable an installed feature declares; returns what was set.

    `cannot_draft` (asked only when the speculative-decoding default would be set) gives the reason
    the model cannot draft, or None; with a reason that default is skipped, with one note on stderr.
    `declares_batch_invariant` says whether the back end declares the batch_invariant capability;
    the batch-invariance default is applied only where it does (otherwise the feature would refuse
    to start), with one note on stderr when skipped."""
    from deepinfer import envs

    declared = envs.feature_variables()
    applied = {}
    for var, value, feature, accelerators in SEED_ENV_DEFAULTS:
        if var not in declared or var in os.environ or (accelerators and accelerator not in accelerators):
            continue
        if feature == "eplb" and disable_eplb:
            continue
        if feature == "dspark" and cannot_draft is not None:
            reason = cannot_draft()
            if reason:
                print(speculation_off_note(value, reason), file=sys.stderr, flush=True)
                continue
        if feature == "batch_invariant" and not (declares_batch_invariant and declares_batch_invariant()):
            print(f"note: {var}={value} (the seeds' default on {accelerator}) not applied: this back end does "
                  f"not declare the batch_invariant capability", file=sys.stderr, flush=True)
            continue
        os.environ[var] = applied[var] = value
    return applied


def feature_tables(args: argparse.Namespace) -> dict[str, dict] | None:
    from deepinfer.plugins import FEATURE_GROUP, discover

    if args.disable_eplb and "eplb" in discover(FEATURE_GROUP):
        return {"eplb": {"enabled": False}}
    return None


def accelerator_declares_batch_invariant() -> bool:
    """Whether the selected back end declares `Capabilities.batch_invariant` (False if it cannot start)."""
    from deepinfer.plugins import select_accelerator

    try:
        return bool(select_accelerator(None).capabilities().batch_invariant)
    except Exception:  # a back end that cannot start here reports that itself when the engine builds
        return False


def create_llm(args: argparse.Namespace, sizes: ParallelSizes, accelerator: str):
    from deepinfer import LLM  # imported here: environment set-up must happen before the engine loads

    apply_seed_env_defaults(accelerator, args.disable_eplb, cannot_draft=lambda: drafter_unsupported(args.model_name),
                            declares_batch_invariant=accelerator_declares_batch_invariant)
    return LLM(model=args.model_name, accelerator=accelerator, dtype=args.dtype, features=feature_tables(args), max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
               max_num_seqs=MAX_NUM_SEQS, gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
               sampler_force_topk=args.sampler_force_topk, ep=sizes.ep, dp=sizes.dp, cp=sizes.cp)


def my_share(items: list, ctx: RankContext) -> list[int]:
    """The indices this DP rank serves: round-robin over the DP ranks."""
    return [i for i in range(len(items)) if i % ctx.layout.dp == ctx.dp_rank]


def generate_share(llm, ctx: RankContext, prompts: list, params: list, use_tqdm: bool) -> dict[int, object]:
    """This rank's share of `prompts`, then the expert-parallel lockstep: a rank that is done keeps
    serving its experts until every rank is (deepinfer.parallel.expert_parallel)."""
    from deepinfer.parallel.expert_parallel import idle_until_peers_done

    mine = my_share(prompts, ctx)
    outputs = llm.generate([prompts[i] for i in mine], [params[i] for i in mine], use_tqdm=use_tqdm) if mine else []
    idle_until_peers_done()
    return dict(zip(mine, outputs))


def check_structured_output(llm, ctx: RankContext) -> tuple[dict[int, str], list[str]]:
    from _structured_output import check_outputs, sample_requests

    prompts, params = sample_requests()
    outputs = generate_share(llm, ctx, prompts, params, use_tqdm=False)
    lines = {i: format_result(ctx.dp_rank, prompts[i], out) for i, out in outputs.items()}
    tok = llm.tokenizer
    eos = getattr(tok, "eos_token_id", None)
    mine = sorted(outputs)
    return lines, check_outputs([params[i] for i in mine], [outputs[i] for i in mine], eos,
                                tok.decode([eos]) if eos is not None else "")


def image_samples(llm, args: argparse.Namespace) -> tuple[list, list, list[str], str | None]:
    """The image samples (prompts, params, texts shown) when the model reads images, else empty
    lists and the reason they are skipped (one line for stderr)."""
    refusal = llm.image_input_unsupported
    if refusal is None and llm.image_placeholder is None:
        refusal = "the model's tokenizer has no text for its image token"
    if refusal is None:
        try:
            import PIL  # noqa: F401
        except ImportError:
            refusal = "Pillow is not installed (pip install \"deepinfer[vision]\")"
    note = image_samples_note(refusal, args.long_context)
    if note is not None:
        return [], [], [], note
    return (*prepare_image_prompts(llm.image_placeholder, args.greedy), None)


def run_rank(ctx: RankContext, args: argparse.Namespace, accelerator: str) -> dict:
    """One rank's work; returns what the first process prints (sample lines keyed by sample index)."""
    start = time.perf_counter()
    rank = ctx.dp_rank
    result: dict = {"status": 0, "header": [], "lines": {}, "checked": {}, "errors": []}
    try:
        llm = create_llm(args, ctx.layout, accelerator)
    except REFUSALS as e:  # a back end, model, setting or feature the engine refuses, in its words
        if not ctx.layout.is_single:
            raise  # the other ranks would wait for this one in a collective: end the launch
        print(error_line(e), file=sys.stderr, flush=True)
        return {**result, "status": 1}
    info = llm.build_info
    if info.is_default_model:
        result["header"].append(f"Using the embedded default model (a small DeepSeek-V4.1 with its DSpark drafter, "
                                f"trained on Shakespeare's plays: expect Elizabethan English, not answers) at "
                                f"{info.model_path}. Pass --model_name to use a real checkpoint.")
    else:
        result["header"].append(f"Model: {info.model_path}")
    prompts, params = prepare_offline_prompts(llm.tokenizer, args.long_context, args.greedy,
                                              args.long_context_input_tokens, args.long_context_output_tokens)
    shown = [p if isinstance(p, str) else p.get("prompt") if isinstance(p, dict) else None for p in prompts]
    image_prompts, image_params, image_shown, skipped = image_samples(llm, args)
    if skipped is not None and ctx.is_first:
        result["header_notes"] = [skipped]
    prompts, params, shown = prompts + image_prompts, params + image_params, shown + image_shown
    outputs = generate_share(llm, ctx, prompts, params, use_tqdm=ctx.is_first)
    for i, out in outputs.items():
        result["lines"][i] = format_result(rank, shown[i], out)
    if args.check_structured_output:
        result["checked"], problems = check_structured_output(llm, ctx)
        if problems:
            result["errors"].append(f"[rank {rank}] structured output check FAILED:\n  " + "\n  ".join(problems))
            result["status"] = 1
    failed = sum(o.error is not None for o in outputs.values())
    if failed:  # each failed sample's line says why; the run must not look successful
        result["errors"].append(f"error: {failed} of {len(outputs)} samples failed (their lines say why)")
        result["status"] = 1
    total = sum(len(o.outputs[0].token_ids) for o in outputs.values())
    # a summary, not a sample: only sample lines start with "DP <rank>;" (scripts parse them)
    who = f"{rank}" if ctx.layout.cp == 1 else f"{rank}, CP rank {ctx.rank % ctx.layout.cp}"
    result["errors"].append(f"[rank {who}] {len(outputs)} samples, {total} output tokens in "
                            f"{time.perf_counter() - start:.1f} s")
    llm.shutdown()
    return result


def print_results(results: list[dict], check_structured: bool, samples: bool = True) -> int:
    """Print the ranks' sample lines in the samples' original order (as one process would);
    `samples` False (a node other than node 0, which prints them): only the ranks' summaries."""
    if not samples:
        results = [{**r, "header": [], "lines": {}, "checked": {}} for r in results]
    for line in results[0]["header"] if results else []:
        print(line, flush=True)
    disagree = []
    for key in ("lines", "checked"):
        merged: dict[int, str] = {}
        for r in results:  # the ranks of a CP group serve the same samples: they must agree
            for i, line in r[key].items():
                if merged.setdefault(i, line) != line:
                    disagree.append(i)
        for i in sorted(merged):
            print(merged[i], flush=True)
    for r in results:
        for line in r.get("header_notes", []):
            print(line, file=sys.stderr, flush=True)
    for r in results:
        for line in r["errors"]:
            print(line, file=sys.stderr, flush=True)
    status = max((r["status"] for r in results), default=0)
    if disagree:
        print(f"error: the context-parallel ranks printed different outputs for samples {sorted(set(disagree))}",
              file=sys.stderr, flush=True)
        status = 1
    if check_structured and status == 0:
        print("structured output check passed", file=sys.stderr, flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # refusals before any process starts: the back end, the layout, the model
        accelerator = accelerator_name()
        sizes = resolve_parallel(args.ep, args.dp, args.cp, accelerator)
        check_context_parallel_model(args.model_name, sizes.cp)
        if args.long_context:
            check_long_context(args.model_name, args.long_context_input_tokens, args.long_context_output_tokens)
    except REFUSALS as e:
        print(error_line(e), file=sys.stderr)
        return 2
    from deepinfer.plugins import select_accelerator_class

    try:
        results = launch_dp(run_rank, sizes, select_accelerator_class(accelerator), (args, accelerator),
                            threads_per_rank=args.threads_per_rank)
    except KeyboardInterrupt:
        exit_now_on_interrupt()
    except ParallelConfigError as e:
        print(error_line(e), file=sys.stderr)
        return 2
    except RankFailed as e:
        print(error_line(e), file=sys.stderr, flush=True)
        return 1
    if sizes.node_rank > 0:
        print(f"node {sizes.node_rank} of {sizes.nodes}: node 0 prints the samples", file=sys.stderr, flush=True)
    return print_results(results, args.check_structured_output, samples=sizes.node_rank == 0)


def exit_now_on_interrupt() -> None:
    """Ctrl-C: leave at once. A forward already running on the worker thread cannot be stopped
    mid-kernel, and waiting for it (a long prefill takes many seconds on a CPU) is not what Ctrl-C
    asks for; the operating system reclaims everything."""
    print("interrupted", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
