"""Continuous batching: which requests run this step, and how many tokens each.

Policy (vLLM v1 style, one token budget per step):
- running requests first, decodes (one token left) before prefill chunks, oldest first;
- then waiting requests, strictly first come first served, while `max_num_seqs` and the token
  budget allow and the cache has room for their first chunk;
- a prompt longer than the remaining budget is prefilled in chunks over several steps;
- when the cache is full, the newest running request is preempted by recompute: its slot and
  blocks are freed, it goes back to the waiting queue with its generated tokens kept, and later
  recomputes prompt + generated tokens and continues where it stopped.

Speculative decoding (`speculative`): a decode carries its drafts (`Request.draft_token_ids`, at
most what the budget, max_tokens and max_model_len leave room for) and is scheduled as 1 + m query
tokens; the drafts' positions count as computed until the engine rolls back the rejected ones. A
request whose step is still in flight is not scheduled again until its result is applied.

The scheduler never touches a device: `schedule()` returns a `SchedulerOutput`, the typed contract
the runner executes. It works with steps in flight (async pipeline): a token sampled by a step that
has not finished yet is counted in `num_pending_tokens` and scheduled as a placeholder input.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from deepinfer.engine.cache_manager import CacheManager
from deepinfer.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    context_len: int  # tokens already in the model state (first position of this chunk)
    token_ids: list[int]  # known input tokens of this chunk
    num_placeholders: int  # trailing inputs sampled by the step in flight (filled by the runner)
    sample: bool  # this chunk reaches the end of the known tokens: sample the next token
    output_index: int  # index among generated tokens of the token sampled after this chunk
    #: speculative decoding: drafts verified after the last known token (a decode step only)
    draft_token_ids: list[int] = field(default_factory=list)

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


@dataclass
class SchedulerOutput:
    step_id: int
    scheduled: list[ScheduledRequest]
    preempted: list[str] = field(default_factory=list)
    num_waiting: int = 0
    num_running: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.query_len for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampled(self) -> list[ScheduledRequest]:
        return [s for s in self.scheduled if s.sample]


class Scheduler:
    def __init__(self, cache: CacheManager, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        #: speculative decoding is on: decodes carry their drafts, and a request whose step is still
        #: in flight waits for it (its next input depends on how many drafts were accepted)
        self.speculative = False
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._step = 0
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        if not self.waiting or self.waiting[-1].arrival_index < request.arrival_index:
            self.waiting.append(request)  # new arrivals: O(1)
            return
        keys = [r.arrival_index for r in self.waiting]  # a preempted request returns to its place
        self.waiting.insert(bisect.bisect(keys, request.arrival_index), request)

    def finish_request(self, request: Request) -> None:
        """Remove a finished request from the queues and free its cache (call after `finish`)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.free(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids = []  # a recomputed request drafts anew after its last chunk
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self._enqueue(request)

    def _done_generating(self, r: Request) -> bool:
        """Its in-flight token already completes it (async): nothing more to schedule."""
        return (r.num_outputs_with_pending >= r.params.max_tokens
                or r.num_tokens_with_pending >= self.max_model_len)

    def _num_drafts(self, r: Request, remaining: int, budget: int) -> int:
        """Drafts to verify with a decode: as many as it has, within the token budget and without
        passing max_tokens or max_model_len even if all of them are accepted."""
        if not (self.speculative and r.draft_token_ids and remaining == 1):
            return 0
        return max(0, min(len(r.draft_token_ids), budget - 1, r.params.max_tokens - r.num_outputs_with_pending - 1,
                          self.max_model_len - r.num_tokens_with_pending - 1))

    # -- one step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        plan: dict[Request, int] = {}  # request -> new tokens this step (applied at the end)
        drafts: dict[Request, int] = {}  # request -> drafts among them
        preempted: list[str] = []  # its cache was just freed for lack of room: not readmitted now

        def remaining(r: Request) -> int:
            return r.num_tokens_with_pending - r.num_computed_tokens

        # Running requests: decodes first, then prefill chunks; oldest first within each.
        for req in sorted(self.running, key=lambda r: (remaining(r) > 1, r.arrival_index)):
            if budget == 0:
                break
            if req not in self.running or remaining(req) <= 0 or self._done_generating(req):
                continue
            if self.speculative and req.num_pending_tokens:
                continue
            m = self._num_drafts(req, remaining(req), budget)
            n = min(remaining(req), budget) + m
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
            n = min(remaining(req), budget)
            if not self.cache.allocate(req, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan[req] = n
            budget -= n

        scheduled = [self._commit(req, n, drafts.get(req, 0)) for req, n in plan.items()]
        self._step += 1
        return SchedulerOutput(step_id=self._step, scheduled=scheduled, preempted=preempted,
                               num_waiting=len(self.waiting), num_running=len(self.running))

    def _commit(self, req: Request, n: int, num_drafts: int = 0) -> ScheduledRequest:
        start = req.num_computed_tokens
        end = start + n - num_drafts
        known_end = min(end, req.num_tokens)
        sample = end == req.num_tokens_with_pending
        out = ScheduledRequest(
            request=req, context_len=start, token_ids=req.tokens(start, known_end),
            num_placeholders=end - known_end, sample=sample, output_index=req.num_outputs_with_pending,
            draft_token_ids=req.draft_token_ids[:num_drafts])
        # the drafts' positions are written too; the engine rolls back those rejected
        req.num_computed_tokens = end + num_drafts
        if sample:
            req.num_pending_tokens += 1
        return out
