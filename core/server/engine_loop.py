"""One engine's serving loop body: apply queued adds and aborts, step, hand each request its new tokens.

Whoever owns the engine calls it from one thread (the only one that touches the `EngineCore`; the
scheduler is not thread-safe): the in-process front end's engine thread (`async_engine.py`) and
each data-parallel rank's process (`dp_worker.py`). Where the deltas go is the owner's `post`
callback: an asyncio queue in the same process, or a pipe to the front end.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.cache_manager import PrefixCacheStats
from deepinfer.engine.engine_core import EngineCore
from deepinfer.engine.request import Request
from deepinfer.outputs import Logprob
from deepinfer.server.metrics import Histogram

logger = logging.getLogger("deepinfer")

#: finish reason of a request whose engine went away (a data-parallel rank died): HTTP 503
UNAVAILABLE = "unavailable"


@dataclass
class Delta:
    """What one engine step produced for one sample (`index`) of a request. A request of several
    samples (`n`, `best_of`) gets one final delta per sample; the stream ends with the final delta
    after which no sample is left (`samples_left` 0, `done`). The first delta (no tokens) says the
    request was admitted, or is already the final one, with the admission error."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""  # the final text (stop strings cut), when finished
    num_prompt_tokens: int = 0
    index: int = 0  # the sample
    samples_left: int = 0  # samples of the request still running after this delta
    logprobs: list[dict[int, Logprob]] | None = None  # per new token, when the request asks for logprobs
    cumulative_logprob: float = 0.0  # of the sample's tokens so far (raw distribution)
    #: the prompt's log-probabilities (`prompt_logprobs`), once, with the first delta after they are known
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    queue_s: float | None = None  # with the first tokens: seconds the request waited for a slot

    @property
    def done(self) -> bool:
        """The request's last delta."""
        return self.finished and self.samples_left == 0


@dataclass
class EngineSnapshot:
    """Engine gauges, refreshed by the engine's thread after each step (read by /metrics)."""

    waiting: int = 0
    running: int = 0
    cache_usage: float = 0.0
    slots_used: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_cache: PrefixCacheStats | None = None  # the prefix_cache feature's counters (None: off)
    step_seconds: Histogram = field(default_factory=Histogram)


@dataclass
class _Tracked:
    """A request being served: tokens handed out per sample, the samples reported finished."""

    request: Request
    sent: list[int]
    reported: set[int] = field(default_factory=set)
    prompt_sent: bool = False
    queue_sent: bool = False


#: a command for the loop: ("add", (request_id, prompt, SamplingParams)) or ("abort", request_id)
Command = tuple[str, Any]


class EngineLoop:
    def __init__(self, engine: EngineCore, post: Callable[[str, Delta], None], snapshot: EngineSnapshot):
        self.engine = engine
        self.post = post
        self.snapshot = snapshot
        self._tracked: dict[str, _Tracked] = {}

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def run_once(self, commands: list[Command]) -> float | None:
        """Apply `commands`, then one step if there is work; the step's seconds (None: no step)."""
        self.apply(commands)
        seconds = None
        if self.engine.has_unfinished():
            start = time.perf_counter()
            finished = self.engine.step()
            seconds = time.perf_counter() - start
            self.snapshot.step_seconds.observe(seconds)
            self._hand_out(finished)
        self._refresh_snapshot()
        return seconds

    def fail_all(self, message: str) -> None:
        """End every open request with `message` (the loop cannot go on)."""
        for rid in list(self._tracked):
            self.post(rid, Delta([], finished=True, finish_reason="error", error=message))
        self._tracked.clear()

    def apply(self, commands: list[Command]) -> None:
        aborts = [payload for kind, payload in commands if kind == "abort"]
        for kind, payload in commands:
            if kind != "add":
                continue
            rid, prompt, params = payload
            if rid in aborts:
                continue  # gone before it was admitted
            try:
                req = self.engine.add_request(prompt, params, request_id=rid)
            except Exception:  # admission contract: a bad request never raises; a bug must not kill the loop
                logger.exception("admitting request %s failed", rid)
                self.post(rid, Delta([], True, "error", "the server failed to admit this request"))
                continue
            if req.is_finished:  # refused at admission: the reason is the request's error
                self.post(rid, Delta([], True, req.finish_reason, req.error, req.text, req.num_prompt_tokens))
                continue
            self._tracked[rid] = _Tracked(req, [0] * len(req.members))
            self.post(rid, Delta([], num_prompt_tokens=req.num_prompt_tokens, samples_left=len(req.members)))
        if aborts:
            self.engine.abort(aborts)
            for rid in aborts:
                self._tracked.pop(rid, None)

    def _hand_out(self, finished: list[Request]) -> None:
        for rid, t in list(self._tracked.items()):
            members = t.request.members
            for i, m in enumerate(members):
                if i in t.reported:
                    continue
                new = m.output_token_ids[t.sent[i]:]
                if not new and not m.is_finished:
                    continue
                delta = Delta(list(new), num_prompt_tokens=m.num_prompt_tokens, index=i,
                              logprobs=m.logprobs[t.sent[i]:] if m.logprobs is not None else None,
                              cumulative_logprob=m.sum_logprob)
                t.sent[i] += len(new)
                if m.is_finished:
                    t.reported.add(i)
                    delta.finished, delta.finish_reason = True, m.finish_reason
                    delta.error, delta.text = m.error, m.text
                delta.samples_left = len(members) - len(t.reported)
                if not t.prompt_sent and t.request.prompt_logprobs is not None and t.request.prompt_scored:
                    delta.prompt_logprobs, t.prompt_sent = t.request.prompt_logprobs, True
                if not t.queue_sent and m.scheduled_time is not None and (new or m.is_finished):
                    delta.queue_s, t.queue_sent = m.scheduled_time - m.arrival_time, True
                self.post(rid, delta)
            if len(t.reported) == len(members):
                del self._tracked[rid]

    def _refresh_snapshot(self) -> None:
        s, engine = self.snapshot, self.engine
        stats = engine.stats()
        s.waiting, s.running = len(engine.scheduler.waiting), len(engine.scheduler.running)
        s.cache_usage, s.slots_used = stats.usage, stats.slots_used
        s.num_steps, s.num_preemptions = engine.num_steps, engine.scheduler.num_preemptions
        s.prefix_cache = stats.prefix_cache
