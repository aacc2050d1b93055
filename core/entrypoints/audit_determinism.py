"""`deepinfer audit-determinism`: does a request's output depend on how it was batched?

    deepinfer audit-determinism [--model DIR] [--accelerator NAME] [--dtype bfloat16]
        [--requests 12] [--max-tokens 16] [--temperature 0] [--batch-sizes 3,12]
        [--batch-invariant on|off|env] [--no-preemption] [--logprobs 20] [--json]

Runs a set of requests (prompts of different lengths) first each alone, then together with
`max_num_seqs` set to each batch size, in the given order and reversed, with a small token budget
so that prompts are split into prefill chunks, and (unless --no-preemption) with a cache too small
for all of them so that requests are preempted and recomputed. Every request is compared with its
run alone: its tokens, and its top-N log-probabilities (the logits minus their log-normaliser, fp32)
bit for bit. Sampled requests (temperature > 0) each get a `seq_seed`. The report says how many
requests were compared per run, how many differ, and where each first differs. Exit status 0 when
nothing differs, 1 otherwise.

Only the public `LLM` API is used, so the audit runs on any back end. `audit()` is the function
behind the command.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.sampling_params import SamplingParams

GiB = 1 << 30


class AuditSettings(BaseModel):
    """What the audit runs (the command's flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="checkpoint directory; None: the embedded default model")
    accelerator: str | None = None
    dtype: str | None = Field("bfloat16", description="compute dtype (None: the checkpoint's)")
    num_requests: int = Field(12, ge=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0, description="0: greedy; above: sampled with seq_seed = seed + i")
    seed: int = Field(0, ge=0, description="seed of the prompts and of the requests' seq_seed")
    min_prompt_len: int = Field(3, ge=1)
    prompt_len_step: int = Field(5, ge=0, description="request i's prompt has min_prompt_len + i * step tokens")
    batch_sizes: tuple[int, ...] = Field((3, 12), min_length=1, description="max_num_seqs of the batched runs")
    chunk_tokens: int = Field(16, ge=1, description="token budget per step of the batched runs (chunks prompts)")
    preemption: bool = Field(True, description="also run with a cache too small for all requests")
    logprobs: int = Field(20, ge=0, description="top log-probabilities compared per position")
    batch_invariant: Literal["on", "off", "env"] = Field(
        "env", description="on/off: enable/disable the batch_invariant feature; env: as the environment says")
    max_model_len: int | None = Field(None, ge=1, description="None: the longest prompt plus max_tokens")


class RunResult(BaseModel):
    name: str  # which run: "batch 12", "batch 12 reversed", "preemption", ...
    compared: int  # requests compared with their run alone
    token_differences: int  # requests whose tokens differ
    logprob_differences: int  # requests whose top log-probabilities differ somewhere (bitwise)
    first_difference: dict[int, int] = {}  # request index -> first output position that differs
    preemptions: int = 0


class AuditReport(BaseModel):
    settings: AuditSettings
    runs: list[RunResult]

    @property
    def compared(self) -> int:
        return sum(r.compared for r in self.runs)

    @property
    def differing(self) -> int:
        """Request comparisons in which tokens or log-probabilities differ."""
        return sum(len(r.first_difference) for r in self.runs)

    def text(self) -> str:
        s = self.settings
        mode = "greedy" if s.temperature == 0 else f"temperature {s.temperature}, seq_seed"
        lines = [f"audit-determinism: {s.num_requests} requests, {s.max_tokens} tokens each, {mode}, "
                 f"batch_invariant={s.batch_invariant}",
                 f"{'run':<34} {'compared':>8} {'tokens differ':>14} {'logprobs differ':>16}  first differing position"]
        for r in self.runs:
            where = ", ".join(f"req {i}: {p}" for i, p in sorted(r.first_difference.items())) or "-"
            name = r.name + (f" ({r.preemptions} preemptions)" if r.preemptions else "")
            lines.append(f"{name:<34} {r.compared:>8} {r.token_differences:>14} {r.logprob_differences:>16}  {where}")
        lines.append(f"total: {self.compared} comparisons, {self.differing} differ")
        return "\n".join(lines)


def _prompts(s: AuditSettings, vocab: int) -> list[list[int]]:
    rng = random.Random(s.seed)
    high = max(4, min(vocab, 1000))  # ids 3.. avoid the usual BOS/EOS/pad ids
    return [[rng.randrange(3, high) for _ in range(s.min_prompt_len + i * s.prompt_len_step)]
            for i in range(s.num_requests)]


def _params(s: AuditSettings) -> list[SamplingParams]:
    return [SamplingParams(temperature=s.temperature, max_tokens=s.max_tokens, ignore_eos=True,
                           logprobs=s.logprobs, seq_seed=None if s.temperature == 0 else s.seed + i)
            for i in range(s.num_requests)]


def _trace(output) -> tuple[list[int], list[dict[int, float]]]:
    completion = output.outputs[0]
    logprobs = [{t: lp.logprob for t, lp in pos.items()} for pos in completion.logprobs or []]
    return list(completion.token_ids), logprobs


def _first_difference(a: tuple[list[int], list[dict[int, float]]], b: tuple[list[int], list[dict[int, float]]]
                      ) -> int | None:
    (ta, la), (tb, lb) = a, b
    n = max(len(ta), len(tb), len(la), len(lb))
    for i in range(n):
        if ta[i:i + 1] != tb[i:i + 1] or la[i:i + 1] != lb[i:i + 1]:
            return i
    return None


def audit(settings: AuditSettings, make_llm: Callable[..., Any] | None = None) -> AuditReport:
    """Run the audit. `make_llm(**engine_settings)` builds an engine (default: `deepinfer.LLM`)."""
    if make_llm is None:
        from deepinfer import LLM as make_llm
    s = settings
    base: dict[str, Any] = dict(model=s.model, accelerator=s.accelerator, dtype=s.dtype)
    if s.batch_invariant != "env":
        base["features"] = {"batch_invariant": {"enabled": s.batch_invariant == "on"}}
    longest = s.min_prompt_len + (s.num_requests - 1) * s.prompt_len_step
    base["max_model_len"] = s.max_model_len or longest + s.max_tokens
    params = _params(s)

    alone_llm = make_llm(**base, max_num_seqs=1, max_num_batched_tokens=max(longest, 256))
    try:
        prompts = _prompts(s, alone_llm.engine.vocab_size)
        alone = [_trace(alone_llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params)]
        per_request = alone_llm.build_info.pool.bytes_per_max_request
    finally:
        alone_llm.shutdown()

    runs: list[tuple[str, dict[str, Any], list[int]]] = []
    order = list(range(s.num_requests))
    for size in s.batch_sizes:
        engine = dict(max_num_seqs=size, max_num_batched_tokens=s.chunk_tokens)
        runs.append((f"batch {size}", engine, order))
        runs.append((f"batch {size} reversed", engine, order[::-1]))
    if s.preemption:  # room for about 2.5 full-length requests: the newest running ones are preempted
        size = max(max(s.batch_sizes), 3)
        runs.append(("preemption", dict(max_num_seqs=size, max_num_batched_tokens=s.chunk_tokens,
                                        cache_memory_gb=2.5 * per_request / GiB), order))
    results = []
    for name, engine, run_order in runs:
        llm = make_llm(**base, **engine)
        try:
            outs = llm.generate([prompts[i] for i in run_order], [params[i] for i in run_order], use_tqdm=False)
            preemptions = int(llm.stats()["num_preemptions"])
        finally:
            llm.shutdown()
        traces = {i: _trace(o) for i, o in zip(run_order, outs)}
        first = {i: p for i in run_order if (p := _first_difference(alone[i], traces[i])) is not None}
        results.append(RunResult(
            name=name, compared=len(run_order),
            token_differences=sum(traces[i][0] != alone[i][0] for i in run_order),
            logprob_differences=sum(traces[i][1] != alone[i][1] for i in run_order),
            first_difference=first, preemptions=preemptions))
    return AuditReport(settings=s, runs=results)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch-sizes {text!r}: give comma-separated integers, e.g. 3,12") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--batch-sizes {text!r}: give positive integers, e.g. 3,12")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer audit-determinism",
                                description="Compare requests run alone with the same requests in batches of "
                                            "several sizes and orders, chunked and preempted.")
    p.add_argument("--model", help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--accelerator", help="back end (default: DEEPINFER_ACCELERATOR or auto-selection)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (default bfloat16; auto: the checkpoint's)")
    p.add_argument("--requests", type=int, default=12, dest="num_requests")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 greedy (default); above 0: sampled with seq_seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-sizes", type=_sizes, default=(3, 12), help="max_num_seqs of the batched runs (default 3,12)")
    p.add_argument("--chunk-tokens", type=int, default=16, help="token budget per step of the batched runs")
    p.add_argument("--no-preemption", dest="preemption", action="store_false", help="skip the preemption run")
    p.add_argument("--logprobs", type=int, default=20, help="top log-probabilities compared per position")
    p.add_argument("--batch-invariant", choices=("on", "off", "env"), default="env",
                   help="enable or disable the batch_invariant feature (default: as DEEPINFER_BATCH_INVARIANT says)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    as_json = args.pop("json")
    if args["dtype"] == "auto":
        args["dtype"] = None
    try:
        settings = AuditSettings(**args)
    except ValueError as exc:
        print(f"error: invalid audit settings: {exc}", file=sys.stderr)
        return 2
    report = audit(settings)
    if as_json:
        print(json.dumps({**report.model_dump(), "compared": report.compared, "differing": report.differing},
                         indent=2))
    else:
        print(report.text())
    return 0 if report.differing == 0 else 1
