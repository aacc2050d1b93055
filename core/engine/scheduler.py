"""Continuous batching: which requests run this step and how many tokens each, and what the step did.

The scheduler is the only writer of request state. Two calls per step:

- `schedule()` -> `SchedulerOutput`: the typed contract the runner executes (the runner reads
  nothing else). Policy (vLLM v1 style, one token budget per step): running requests first,
  decodes (one token left) before prefill chunks, oldest first; then waiting requests, strictly
  first come first served, while `max_num_seqs` and the token budget allow and the cache has room
  for their first chunk. A prompt longer than the remaining budget is prefilled in chunks over
  several steps. When the cache is full, the newest running request is preempted by recompute: its
  slot and blocks are freed, it goes back to the waiting queue with its generated tokens kept, and
  later recomputes prompt + generated tokens and continues where it stopped.
- `update_from_output(scheduler_output, runner_output)`: applies the step's sampled tokens (the
  logits processors' `accept`, logprobs, stop checks), finishes requests, and for speculative
  decoding rolls `num_computed_tokens` back over the rejected drafts and stores the next drafts.

It works with steps in flight (async pipeline): a token sampled by a step whose result has not
been applied yet is counted in `num_pending_tokens` and scheduled as a placeholder input.

Prefix cache (`cache.prefix_cache`, attached by the prefix_cache feature): a request admitted
from the waiting queue starts after the longest cached prefix of its tokens (at most all but the
last, so that it still computes the logits it samples from); the step restores that state before
its forward (`ScheduledRequest.prefix_hit`). Prefill chunks then end on multiples of the cache's
`block_tokens` when they cross one (only the last, shorter chunk of a prompt does not); when
earlier requests shared a longer prefix whose state was never snapshotted (it fell inside one of
their chunks), the first chunk ends there instead. Every chunk or decode that ends on such a
multiple snapshots the state after its forward (`ScheduledRequest.prefix_capture`), committed
under the request's tokens when the step is applied.

Prompt log-probabilities (`SamplingParams.prompt_logprobs`): each prompt chunk of such a request
also asks for the logits of its positions (`ScheduledRequest.prompt_positions`), each scoring the
next prompt token; it never starts after a cached prefix (those positions would have no logits),
and a request recomputed after a preemption scores only the positions it had not scored.

Several samples of one prompt (`n`, `best_of`; the request's `group`): only the first member is
queued. In the step that samples its first token (its prompt is then in the model state) the
others are forked from it (`SchedulerOutput.forked`): each takes a slot and blocks, samples its own
first token from the first member's last logits row, and gets a copy of the first member's state
after the step's forward (`SchedulerOutput.copy_forks`), so the prompt is prefilled once. A member
that does not fit then (slots, blocks, max_num_seqs) is queued to prefill on its own.

Speculative decoding (`speculator`): a decode carries its drafts (at most what the budget,
max_tokens and max_model_len leave room for) and is scheduled as 1 + m query tokens; the drafts'
positions count as computed until the update rolls back the rejected ones. A request whose step
is still in flight is not scheduled again until its result is applied (its next input depends on
how many drafts were accepted).
"""
from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from deepinfer.engine.cache_manager import CacheManager, PrefixCapture, PrefixHit, copy_sequence_state
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.speculative import Drafts, SpeculativeDecoder
from deepinfer.engine.structured_masks import StructuredMasks
from deepinfer.models.interface import CacheTensors
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger("deepinfer")

DEAD_END = "grammar_dead_end"


@dataclass
class ScheduledRequest:
    """One request's share of a step. Everything the runner and the drafter read about the
    request; the cache fields are taken from the request when this entry is made."""

    request: Request
    context_len: int  # tokens already in the model state (first position of this chunk)
    token_ids: list[int]  # known input tokens of this chunk
    num_placeholders: int  # trailing inputs sampled by the step in flight (filled by the runner)
    sample: bool  # this chunk reaches the end of the known tokens: sample the next token
    output_index: int  # index among generated tokens of the token sampled after this chunk
    #: speculative decoding (a decode step only): drafts verified after the last known token, the
    #: distributions they were drawn from (None: greedy drafts) and the drafter's confidences
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    draft_confidence: list[float] = field(default_factory=list)
    draft_limit: int = 0  # the most drafts to propose for the request's next step
    #: prefix cache: the cached prefix to restore before the forward (context_len is its length), and
    #: the snapshot to take after it (this chunk ends on a block boundary)
    prefix_hit: PrefixHit | None = None
    prefix_capture: PrefixCapture | None = None
    #: positions of this chunk whose logits score the next prompt token (prompt_logprobs)
    prompt_positions: range = range(0)
    #: a forked sample: the request id of the member whose last logits row it samples from and
    #: whose state it copies (it has no input rows of its own)
    fork_of: str | None = None
    slot: int | None = field(init=False)
    block_ids: dict[str, list[int]] = field(init=False)
    num_known_tokens: int = field(init=False)  # prompt + generated tokens known when scheduled
    constrained: bool = field(init=False)  # logits processors track the request (bitmasks)

    def __post_init__(self) -> None:
        r = self.request
        self.slot = r.slot
        self.block_ids = {name: list(ids) for name, ids in r.block_ids.items()}
        self.num_known_tokens = r.num_tokens
        self.constrained = bool(r.processors)

    @property
    def query_len(self) -> int:
        return len(self.token_ids) + self.num_placeholders + len(self.draft_token_ids)

    @property
    def is_decode(self) -> bool:
        """One known token after generated ones: a decode (verification) step, not a prompt chunk."""
        return self.sample and len(self.token_ids) + self.num_placeholders == 1 and self.output_index > 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def tokens(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end) of the request (end <= num_known_tokens; the token history
        only grows, so this stays valid while the step runs)."""
        if end > self.num_known_tokens:
            raise IndexError(f"tokens up to {end} requested, but {self.num_known_tokens} were known when scheduled")
        return self.request.tokens(start, end)


@dataclass
class SchedulerOutput:
    step_id: int
    scheduled: list[ScheduledRequest]
    preempted: list[str] = field(default_factory=list)
    num_waiting: int = 0
    num_running: int = 0
    cache_tensors: CacheTensors | None = None  # what prefix_hit / prefix_capture / forks copy from and to
    #: samples forked from a member of their group scheduled in this step (sampled after the others)
    forked: list[ScheduledRequest] = field(default_factory=list)

    def restore_prefixes(self) -> None:
        """Write the cached prefixes of this step's prefix hits into their cache (before the forward;
        the executor runs it, in step order, so no step in flight can overwrite it)."""
        for s in self.scheduled:
            if s.prefix_hit is not None:
                s.prefix_hit.restore(self.cache_tensors, s.slot, s.block_ids)

    def copy_forks(self) -> None:
        """Copy each forked sample's source state into its own slot and blocks (after the step's
        model calls, which wrote the source's whole prompt)."""
        if not self.forked:
            return
        sources = {s.request_id: s for s in self.scheduled}
        for f in self.forked:
            src = sources[f.fork_of]
            copy_sequence_state(self.cache_tensors, src.slot, src.block_ids, f.slot, f.block_ids)

    def capture_prefixes(self) -> None:
        """Copy the state of the chunks that end on a block boundary (after the step's model calls)."""
        for s in self.scheduled:
            if s.prefix_capture is not None:
                s.prefix_capture.copy(self.cache_tensors, s.slot, s.block_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.query_len for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampled(self) -> list[ScheduledRequest]:
        """The requests that sample a token, in the order of the step's logits rows."""
        return [s for s in self.scheduled if s.sample] + self.forked


@dataclass
class SampledTokens:
    """One sampled request's result in a step: the tokens it emits, in order (one without
    speculation; the accepted drafts and one target token with it), their raw log-probabilities,
    and whether the position after them had every token masked or non-finite logits (nothing could
    be sampled there)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int] | None = None  # per token, its rank (1 = most likely), when the request asks for logprobs
    top: list[list[tuple[int, float]]] | None = None  # per token, the request's top-k (id, logprob)
    dead: bool = False
    #: the position after the tokens had non-finite logits: what was wrong (the request fails with it)
    error: str | None = None


@dataclass
class PromptScores:
    """Prompt log-probabilities a step computed for one request: the tokens at positions
    `first`, `first` + 1, ... after the ones before them (raw distribution)."""

    first: int
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]] | None = None
    error: str | None = None  # a position's logits were not finite: the request fails with this


@dataclass
class ModelRunnerOutput:
    """What a step computed, by request id: what each sampled request emits, the next drafts, and
    prompt log-probabilities."""

    sampled: dict[str, SampledTokens]
    drafts: dict[str, Drafts] = field(default_factory=dict)
    prompt_scores: dict[str, PromptScores] = field(default_factory=dict)


class Scheduler:
    def __init__(self, cache: CacheManager, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 outputs: OutputProcessor | None = None, masks: StructuredMasks | None = None,
                 speculator: SpeculativeDecoder | None = None):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.outputs = outputs or OutputProcessor(max_model_len=max_model_len)
        self.masks = masks or StructuredMasks([], vocab_size=0)
        #: speculative decoding (None: off); the engine sets it once its features have started
        self.speculator = speculator
        self.requests: dict[str, Request] = {}  # every unfinished request, in admission order
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._step = 0
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request (a sample waiting to be forked is only registered: its source queues)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if request.fork_source is None:
            self._enqueue(request)

    def reject(self, request: Request, problem: str) -> None:
        """Finish a request that admission refused (it was never queued)."""
        request.finish("error", error=problem)
        request.text = self.outputs.final_text(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def apply_failures(self, failures: dict[str, tuple[str, str]]) -> list[Request]:
        """Finish these unfinished requests (the logits processors cannot continue them, or they were
        aborted): id -> (finish reason, message); other ids are ignored. Returns the ones finished."""
        done = []
        for rid, (reason, message) in failures.items():
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, reason, error=message)
                done.append(req)
        return done

    def _enqueue(self, request: Request) -> None:
        if not self.waiting or self.waiting[-1].arrival_index < request.arrival_index:
            self.waiting.append(request)  # new arrivals: O(1)
            return
        keys = [r.arrival_index for r in self.waiting]  # a preempted request returns to its place
        self.waiting.insert(bisect.bisect(keys, request.arrival_index), request)

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None, error: str | None = None) -> None:
        req.finish(reason, stop_reason=stop_reason, error=error)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.free(req)
        self.masks.remove(req)
        self.requests.pop(req.request_id, None)
        if req.fork_source is not None:  # finished while waiting to be forked
            req.fork_source.fork_pending.remove(req)
            req.fork_source = None
        self._release_forks(req)
        req.text = self.outputs.final_text(req)
        self.outputs.release(req.request_id)

    def _release_forks(self, req: Request) -> None:
        """Members still waiting to be forked from `req` (which ends without its first token) are
        queued to prefill on their own."""
        pending, req.fork_pending = req.fork_pending, []
        for f in pending:
            f.fork_source = None
            if not f.is_finished:
                self._enqueue(f)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache.free(request)
        request.num_computed_tokens = 0
        request.drafts = None  # a recomputed request drafts anew after its last chunk
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self._enqueue(request)

    def _done_generating(self, r: Request) -> bool:
        """Its in-flight token already completes it (async): nothing more to schedule."""
        # max_tokens 0 (score the prompt only) still computes the prompt: its sampled token is dropped
        return (r.num_outputs_with_pending >= max(r.params.max_tokens, 1)
                or r.num_tokens_with_pending >= self.max_model_len)

    # -- one step: what to run --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.speculator is not None:
            self._plan_drafts()
        budget = self.max_num_batched_tokens
        plan: dict[Request, int] = {}  # request -> new tokens this step (applied at the end)
        drafts: dict[Request, int] = {}  # request -> drafts among them
        preempted: list[str] = []  # its cache was just freed for lack of room: not readmitted now
        hits: dict[Request, PrefixHit] = {}  # admitted after a cached prefix, restored by the step

        def remaining(r: Request) -> int:
            return r.num_tokens_with_pending - r.num_computed_tokens

        # Running requests: decodes first, then prefill chunks; oldest first within each.
        for req in sorted(self.running, key=lambda r: (remaining(r) > 1, r.arrival_index)):
            if budget == 0:
                break
            if req not in self.running or remaining(req) <= 0 or self._done_generating(req):
                continue
            if self.speculator is not None and req.num_pending_tokens:
                continue
            m = self._num_drafts(req, remaining(req), budget)
            n = self._align(req.num_computed_tokens, min(remaining(req), budget)) + m
            while not self.cache.allocate(req, req.num_computed_tokens + n):
                if self.running == [req]:
                    raise RuntimeError(
                        f"request {req.request_id} needs cache for {req.num_computed_tokens + n} tokens, more than "
                        f"the whole pool holds; the pool must fit one max_model_len={self.max_model_len} request")
                victim = max(self.running, key=lambda r: r.arrival_index)
                if victim in plan:
                    budget += plan.pop(victim)
                    drafts.pop(victim, None)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                plan[req] = n
                drafts[req] = m
                budget -= n

        # Waiting requests, first come first served (a preempted request keeps its place).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending_tokens or req.request_id in preempted:
                break  # its last token is still being sampled, or it was just preempted
            hit = self._lookup_prefix(req)
            start = hit.num_tokens if hit is not None else req.num_computed_tokens
            n = self._align(start, min(req.num_tokens_with_pending - start, budget))
            if hit is not None and hit.split_at > start:
                n = min(n, hit.split_at - start)  # snapshot the prefix other requests share
            if not self.cache.allocate(req, start + n):
                break
            if self.cache.prefix_cache is not None and req.num_computed_tokens == 0:
                self.cache.prefix_cache.record_admission(req.num_tokens, start)
            if hit is not None and hit.num_tokens:
                req.num_computed_tokens = start
                hits[req] = hit
            self.waiting.popleft()
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan[req] = n
            budget -= n

        scheduled = [self._commit(req, n, drafts.get(req, 0), hits.get(req)) for req, n in plan.items()]
        forked = [f for s in scheduled if s.sample and s.request.fork_pending for f in self._fork(s)]
        self._step += 1
        copies = self.cache.prefix_cache is not None or bool(forked)
        return SchedulerOutput(step_id=self._step, scheduled=scheduled, preempted=preempted,
                               num_waiting=len(self.waiting), num_running=len(self.running),
                               cache_tensors=self.cache.tensors if copies else None, forked=forked)

    def _fork(self, source: ScheduledRequest) -> list[ScheduledRequest]:
        """Fork the members waiting on `source`'s request, which samples its first token in this
        step; the ones that do not fit are queued to prefill on their own."""
        leader = source.request
        forked = []
        for f in list(leader.fork_pending):
            fits = self.cache.tensors is not None and len(self.running) < self.max_num_seqs
            if not fits or not self.cache.allocate(f, leader.num_tokens):
                continue
            leader.fork_pending.remove(f)
            f.fork_source = None
            f.status = RequestStatus.RUNNING
            f.scheduled_time = time.monotonic()
            f.num_computed_tokens = leader.num_tokens
            f.num_pending_tokens += 1
            self.running.append(f)
            forked.append(ScheduledRequest(request=f, context_len=leader.num_tokens, token_ids=[],
                                           num_placeholders=0, sample=True, output_index=0,
                                           fork_of=leader.request_id))
        self._release_forks(leader)
        return forked

    def _lookup_prefix(self, req: Request) -> PrefixHit | None:
        """The longest cached prefix a request starting from scratch can reuse (None: none, or off)."""
        prefix = self.cache.prefix_cache
        if prefix is None or req.num_computed_tokens or not req.prompt_scored:
            return None  # (positions restored from the cache would have no logits to score)
        # at most all but the last token: the step must still compute the logits it samples from
        return prefix.lookup(req.tokens(0, req.num_tokens), req.num_tokens - 1)

    def _align(self, start: int, n: int) -> int:
        """With a prefix cache, a chunk [start, start + n) that crosses a multiple of block_tokens
        ends on the last one it crosses, so that its state there can be snapshotted."""
        prefix = self.cache.prefix_cache
        if prefix is None or n <= 1:
            return n
        end = start + n
        aligned = end - end % prefix.block_tokens
        return aligned - start if aligned > start else n

    def _plan_drafts(self) -> None:
        """Speculative decoding with a verification policy: keep, per decode, the drafts it verifies."""
        ready = [r for r in self.running if r.draft_token_ids and not r.num_pending_tokens]
        counts = self.speculator.plan([r.drafts.confidence for r in ready]) if ready else None
        if counts is None:
            return
        for r, m in zip(ready, counts):
            r.drafts = r.drafts.truncate(m) if m else None
            r.num_drafts_planned = m

    def _num_drafts(self, r: Request, remaining: int, budget: int) -> int:
        """Drafts to verify with a decode: as many as it has, within the token budget and without
        passing max_tokens or max_model_len even if all of them are accepted."""
        if not (self.speculator is not None and r.draft_token_ids and remaining == 1):
            return 0
        return max(0, min(len(r.draft_token_ids), budget - 1, r.params.max_tokens - r.num_outputs_with_pending - 1,
                          self.max_model_len - r.num_tokens_with_pending - 1))

    def _commit(self, req: Request, n: int, num_drafts: int = 0, hit: PrefixHit | None = None) -> ScheduledRequest:
        start = req.num_computed_tokens
        end = start + n - num_drafts
        known_end = min(end, req.num_tokens)
        sample = end == req.num_tokens_with_pending
        out = ScheduledRequest(
            request=req, context_len=start, token_ids=req.tokens(start, known_end),
            num_placeholders=end - known_end, sample=sample, output_index=req.num_outputs_with_pending,
            prefix_hit=hit)
        if req.prompt_logprobs is not None:  # positions p < prompt - 1 not scored yet score token p + 1
            out.prompt_positions = range(max(start, len(req.prompt_logprobs) - 1),
                                         max(min(end, req.num_prompt_tokens - 1), start))
        prefix = self.cache.prefix_cache
        if prefix is not None and not num_drafts and end % prefix.block_tokens == 0:
            out.prefix_capture = prefix.capture(req.tokens(0, known_end), end)
        if self.speculator is not None:
            if num_drafts:
                chosen = req.drafts.truncate(num_drafts)
                out.draft_token_ids, out.draft_probs, out.draft_confidence = \
                    chosen.token_ids, chosen.probs, chosen.confidence
            out.draft_limit = self.speculator.draft_limit(req.num_drafts_planned)
        # the drafts' positions are written too; the update rolls back those rejected
        req.num_computed_tokens = end + num_drafts
        if sample:
            req.num_pending_tokens += 1
        return out

    # -- one step: what it did --------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> list[Request]:
        """Apply a finished step's results; returns the requests that finished."""
        finished: list[Request] = []
        outcomes: list[tuple[int, int]] = []  # (drafts verified, drafts accepted) per verification
        for rid, scores in output.prompt_scores.items():  # before the tokens: a finish keeps them
            req = self.requests.get(rid)
            if req is not None:
                self._apply_prompt_scores(req, scores, finished)
        for s in scheduler_output.scheduled:
            capture = s.prefix_capture
            # a request finished before this step was applied may have had its last token discarded
            if capture is not None and not s.request.is_finished and s.request.num_tokens >= capture.end:
                capture.commit(s.request.tokens(0, capture.end))
        for s in scheduler_output.sampled:
            req = s.request
            result = output.sampled[s.request_id]
            req.num_pending_tokens -= 1
            accepted = max(len(result.token_ids) - 1, 0)  # a verification emits the accepted drafts and one more
            if s.draft_token_ids:
                self.speculator.observe(s.draft_confidence, len(s.draft_token_ids), accepted)
            if req.is_finished:
                continue  # finished while the step ran (async); its tokens are discarded
            self._apply_tokens(req, result, finished)
            if self.speculator is not None:
                self._after_verification(s, accepted, output.drafts.get(s.request_id), outcomes)
        if outcomes:
            self.speculator.stats.record_step(outcomes)
        return finished

    def _apply_prompt_scores(self, req: Request, scores: PromptScores, finished: list[Request]) -> None:
        if scores.error is not None:
            logger.warning("request %s failed: %s", req.request_id, scores.error)
            self._finish(req, "error", error=scores.error)
            finished.append(req)
            return
        entries = req.prompt_logprobs
        for i, (logprob, rank) in enumerate(zip(scores.logprobs, scores.ranks)):
            position = scores.first + i
            if position == len(entries):  # a recompute after a preemption may score one again
                top = scores.top[i] if scores.top is not None else ()
                entries.append(self.outputs.logprob_entry(req.token_at(position), logprob, rank, top))

    def _apply_tokens(self, req: Request, result: SampledTokens, finished: list[Request]) -> None:
        if req.params.max_tokens == 0:  # the prompt is scored; the token sampled after it is dropped
            self._finish(req, "length")
            finished.append(req)
            return
        for i, token in enumerate(result.token_ids):
            stop_by_processor = self.masks.accept(req, token)
            if req.processors:
                finished += self.apply_failures(self.masks.pop_failures())
                if req.is_finished:
                    return  # its token is discarded
            self._append(req, token, result, i)
            reason, stop_reason = ("stop", None) if stop_by_processor else self.outputs.check_stop(req)
            if reason is not None:
                self._finish(req, reason, stop_reason=stop_reason)
                finished.append(req)
                return  # the rest is discarded
        if result.error is not None:
            logger.warning("request %s failed: %s", req.request_id, result.error)
            self._finish(req, "error", error=result.error)
            finished.append(req)
        elif result.dead:
            self._finish(req, DEAD_END, error="every token of the vocabulary was masked by the logits processors, "
                                              "so no token could be sampled")
            finished.append(req)

    def _append(self, req: Request, token: int, result: SampledTokens, i: int) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_token_ids.append(token)
        req.sum_logprob += result.logprobs[i]
        if req.params.logprobs is not None:
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.append(self.outputs.logprob_entry(token, result.logprobs[i], result.ranks[i],
                                                           result.top[i] if result.top is not None else ()))

    def _after_verification(self, s: ScheduledRequest, accepted: int, drafts: Drafts | None,
                            outcomes: list[tuple[int, int]]) -> None:
        """Speculative decoding: counts, rollback of the rejected drafts' positions, next drafts.

        The model's state of a rejected draft's position needs no undo: the sequence length is set
        back and the next step overwrites it (the cache rings hold `max_rollback` extra positions).
        Logits processors never saw the rejected drafts (they accept emitted tokens only), and the
        drafter restarts from the committed length at every step."""
        req = s.request
        num_drafts = len(s.draft_token_ids)
        if s.is_decode:
            outcomes.append((num_drafts, accepted))
            req.num_drafts_verified += num_drafts
            req.num_drafts_accepted += accepted
        req.drafts = None
        if req.is_finished or req.status is not RequestStatus.RUNNING:
            return  # finished, or preempted while this step ran (its state is recomputed)
        req.num_computed_tokens = s.context_len + s.query_len - num_drafts + accepted
        if drafts is not None and drafts.token_ids:
            # a draft the request's grammar rejects can never be accepted: not worth verifying
            valid = self.masks.valid_draft_prefix(req, drafts.token_ids)
            req.drafts = drafts.truncate(valid) if valid else None
