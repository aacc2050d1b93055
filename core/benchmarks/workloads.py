"""Prompts and the two timed phases, run through the engine one step at a time.

Both phases submit requests to the engine behind `LLM` (`llm.engine.add_request`, then
`llm.engine.step()` until all finish, exactly what `LLM.generate` does) and record, after every
step, the time and the tokens emitted so far. That gives step-level timing without profiler
overhead, with the async pipeline on as in normal use.

Prefill phase: `num_requests` prompts of `prompt_len` fresh tokens each and `max_tokens=1`. The
engine packs up to `max_num_batched_tokens` (= --prefill_batch_size) prompt tokens into one step.
Time: from submission to the last request's (only) token; tokens: every prompt token.
This engine has no prefix cache, so a prompt is prefilled from position 0: attention over a cached
prefix (the seeds' context_length - non_cached_tokens) is not part of this figure.

Decode phase: `num_requests` prompts of `prompt_len` tokens generate with `ignore_eos`, max_tokens
sized so that every request decodes for at least `decode_steps` steps together even if every
draft is accepted. The decode window starts at the end of the first step after which every request
has its first token (all prompts prefilled) and ends at the end of the step in which the first
request finishes, or as soon as the sequences took `decode_steps` steps each inside it (the rest is
then aborted, which keeps the phase short when few drafts are accepted); prefill work is outside
it. Counted inside it: engine steps, sequence steps (a sequence that emitted tokens in a step counts
once for that step) and the tokens emitted. Without speculation every sequence takes part in every
step (sequence steps = steps x requests). With speculation and the async pipeline a request waits
for its own step in flight (its next input depends on the acceptance), so the engine alternates
requests between steps; sequence steps / requests is then the step count one sequence sees, which
is what avg_SPS means.
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from deepinfer.sampling_params import SamplingParams


def random_prompts(num: int, length: int, vocab_size: int, seed: int = 0, low: int = 3,
                   high: int = 128000) -> list[list[int]]:
    """`num` distinct random token-id prompts (ids in [low, min(high, vocab_size)): ordinary BPE
    tokens of the DeepSeek vocabulary, no BOS/EOS/control tokens)."""
    if num < 1 or length < 1:
        raise ValueError(f"need at least one prompt of at least one token (got {num} x {length})")
    top = min(high, vocab_size)
    if top <= low:
        low, top = 0, vocab_size
    rng = random.Random(seed)
    return [[rng.randrange(low, top) for _ in range(length)] for _ in range(num)]


@dataclass
class StepTrace:
    """What the engine loop saw: per `step()` call, its end time and the total tokens emitted."""

    start: float  # perf_counter at submission
    start_monotonic: float  # the same instant on the engine's clock (request timestamps)
    ends: list[float] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)  # total output tokens after the call
    advances: list[int] = field(default_factory=list)  # running total of (request, call) pairs that emitted
    all_started: list[bool] = field(default_factory=list)  # every request has its first token
    any_finished: list[bool] = field(default_factory=list)


def run_requests(llm: Any, prompts: list[list[int]], params: Any, profiler: Any = None,
                 stop: Callable[[StepTrace], bool] | None = None,
                 progress: Callable[[list[Any], StepTrace], None] | None = None) -> tuple[list[Any], StepTrace]:
    """Submit every prompt, step the engine until all finish (or `stop(trace)` says enough was
    measured: the rest is aborted), trace each step; `progress(requests, trace)` after each step."""
    engine = llm.engine
    trace = StepTrace(start=time.perf_counter(), start_monotonic=time.monotonic())
    requests = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    errors = [r.error for r in requests if r.is_finished and r.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"the engine refused benchmark requests: {errors[0]}")
    try:
        lengths = [0] * len(requests)
        while not all(r.is_finished for r in requests):
            engine.step()
            trace.ends.append(time.perf_counter())
            now = [len(r.output_token_ids) for r in requests]
            grew = sum(1 for a, b in zip(lengths, now) if b > a)
            lengths = now
            trace.emitted.append(sum(now))
            trace.advances.append((trace.advances[-1] if trace.advances else 0) + grew)
            trace.all_started.append(all(r.first_token_time is not None for r in requests))
            trace.any_finished.append(any(r.is_finished for r in requests))
            if profiler is not None:
                profiler.step()
            if progress is not None:
                progress(requests, trace)
            if stop is not None and stop(trace):
                _abort_and_wait(engine)
                break
    except BaseException:
        engine.abort_all()
        raise
    while engine.has_unfinished():  # drain a step still in flight (its tokens are discarded)
        engine.step()
    ok = ("length", "stop", "abort") if stop is not None else ("length", "stop")
    bad = [r for r in requests if r.finish_reason not in ok]
    if bad:
        raise RuntimeError(f"a benchmark request ended with finish_reason {bad[0].finish_reason!r}: {bad[0].error}")
    return requests, trace


def tokens_per_second(trace: StepTrace, tokens: int) -> float | None:
    """Prompt tokens per second of a traced run: its `tokens` prompt tokens over the time until
    every request had its first token."""
    if True not in trace.all_started:
        return None
    seconds = trace.ends[trace.all_started.index(True)] - trace.start
    return tokens / seconds if seconds > 0 else None


def decode_step_seconds(trace: StepTrace) -> float | None:
    """Mean engine step time once every request was prefilled; None when no such step ran."""
    if True not in trace.all_started:
        return None
    first = trace.all_started.index(True)
    steps = len(trace.ends) - 1 - first
    return (trace.ends[-1] - trace.ends[first]) / steps if steps > 0 else None


def _abort_and_wait(engine: Any) -> None:
    """Abort the remaining requests and wait for the step still running on the worker thread, so
    that it is not billed to whatever is timed next. (The async executor's `in_flight` is its
    (step, future) pair; the synchronous executor has none, so there is nothing to wait for.)"""
    in_flight = getattr(engine.executor, "in_flight", None)
    engine.abort_all()
    if in_flight is not None:
        try:
            in_flight[1].result()
        except Exception:
            pass


@dataclass
class PrefillResult:
    requests: int
    prompt_len: int
    tokens: int
    seconds: float
    batches: int  # ceil(tokens / prefill batch tokens): engine steps a perfect packing needs
    mean_ttft_s: float

    def to_json(self) -> dict:
        return asdict(self)


def run_prefill(llm: Any, prompts: list[list[int]], prefill_batch_tokens: int,
                profiler: Any = None, progress: Callable[[list[Any], StepTrace], None] | None = None) -> PrefillResult:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    requests, trace = run_requests(llm, prompts, params, profiler, progress=progress)
    seconds = trace.ends[trace.all_started.index(True)] - trace.start
    ttft = sum(r.first_token_time - trace.start_monotonic for r in requests) / len(requests)
    tokens = sum(len(p) for p in prompts)
    return PrefillResult(len(prompts), len(prompts[0]), tokens, seconds, -(-tokens // prefill_batch_tokens), ttft)


@dataclass
class DecodeResult:
    requests: int
    context_len: int
    max_tokens: int
    steps: int  # engine steps inside the decode window
    sequence_steps: int  # (sequence, step) pairs inside the window in which the sequence emitted tokens
    seconds: float  # length of the decode window
    accepted_tokens: int  # tokens emitted inside the window (all sequences)
    total_seconds: float  # whole phase, prefill included
    total_steps: int
    speculation: dict | None  # the engine's speculative-decoding counters over the whole phase

    def to_json(self) -> dict:
        return asdict(self)


def decode_window(trace: StepTrace) -> tuple[int, int]:
    """Indices (first, last) of the step ends that bound the full-batch decode window."""
    if True not in trace.all_started:
        raise RuntimeError("no step ended with every request started; the decode phase is empty")
    first = trace.all_started.index(True)
    last = trace.any_finished.index(True) if True in trace.any_finished else len(trace.ends) - 1
    if last <= first:
        raise RuntimeError("the decode window is empty: a request finished before every prompt was prefilled; "
                           "raise --decode_tokens or --prefill_batch_size")
    return first, last


def decode_max_tokens(num_requests: int, context_len: int, decode_steps: int, prefill_batch_tokens: int,
                      nextn: int = 0) -> int:
    """max_tokens per decode request: the timed steps plus the steps during which other prompts are
    still being prefilled (requests prefilled in later steps start decoding later), times the most
    tokens one step can emit (1 + nextn)."""
    prefill_steps = -(-num_requests * context_len // prefill_batch_tokens) + 2
    return (decode_steps + prefill_steps) * (1 + nextn)


SPEC_COUNTERS = ("num_verifications", "num_drafts_verified", "num_drafts_accepted", "num_tokens_emitted")


def _spec_counters(engine: Any) -> dict | None:
    stats = getattr(engine, "spec_stats", None)
    return None if stats is None else {k: getattr(stats, k) for k in SPEC_COUNTERS}


def run_decode(llm: Any, prompts: list[list[int]], decode_steps: int, prefill_batch_tokens: int, nextn: int = 0,
               profiler: Any = None, progress: Callable[[list[Any], StepTrace], None] | None = None) -> DecodeResult:
    max_tokens = decode_max_tokens(len(prompts), len(prompts[0]), decode_steps, prefill_batch_tokens, nextn)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = _spec_counters(llm.engine)

    def enough(trace: StepTrace) -> bool:  # every sequence took decode_steps steps inside the window
        if not trace.all_started[-1]:
            return False
        first = trace.all_started.index(True)
        return trace.advances[-1] - trace.advances[first] >= decode_steps * len(prompts)

    _, trace = run_requests(llm, prompts, params, profiler, stop=enough, progress=progress)
    after = _spec_counters(llm.engine)
    first, last = decode_window(trace)
    return DecodeResult(
        requests=len(prompts), context_len=len(prompts[0]), max_tokens=max_tokens, steps=last - first,
        sequence_steps=trace.advances[last] - trace.advances[first], seconds=trace.ends[last] - trace.ends[first],
        accepted_tokens=trace.emitted[last] - trace.emitted[first], total_seconds=trace.ends[-1] - trace.start,
        total_steps=len(trace.ends),
        speculation=None if after is None else {k: after[k] - before[k] for k in SPEC_COUNTERS})
