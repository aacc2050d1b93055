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
from deepinfer.server.metrics import Histogram

logger = logging.getLogger("deepinfer")

#: finish reason of a request whose engine went away (a data-parallel rank died): HTTP 503
UNAVAILABLE = "unavailable"


@dataclass
class Delta:
    """What one engine step produced for one request."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""  # the final text (stop strings cut), when finished
    num_prompt_tokens: int = 0


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


#: a command for the loop: ("add", (request_id, prompt, SamplingParams)) or ("abort", request_id)
Command = tuple[str, Any]


class EngineLoop:
    def __init__(self, engine: EngineCore, post: Callable[[str, Delta], None], snapshot: EngineSnapshot):
        self.engine = engine
        self.post = post
        self.snapshot = snapshot
        self._tracked: dict[str, tuple[Request, int]] = {}  # request, tokens handed out

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
            self._tracked[rid] = (req, 0)
            self.post(rid, Delta([], num_prompt_tokens=req.num_prompt_tokens))
        if aborts:
            self.engine.abort(aborts)
            for rid in aborts:
                self._tracked.pop(rid, None)

    def _hand_out(self, finished: list[Request]) -> None:
        done = {r.request_id for r in finished}
        for rid, (req, sent) in list(self._tracked.items()):
            new = req.output_token_ids[sent:]
            if req.is_finished or rid in done:
                self.post(rid, Delta(list(new), True, req.finish_reason, req.error, req.text, req.num_prompt_tokens))
                del self._tracked[rid]
            elif new:
                self.post(rid, Delta(list(new), num_prompt_tokens=req.num_prompt_tokens))
                self._tracked[rid] = (req, sent + len(new))

    def _refresh_snapshot(self) -> None:
        s, engine = self.snapshot, self.engine
        stats = engine.stats()
        s.waiting, s.running = len(engine.scheduler.waiting), len(engine.scheduler.running)
        s.cache_usage, s.slots_used = stats.usage, stats.slots_used
        s.num_steps, s.num_preemptions = engine.num_steps, engine.scheduler.num_preemptions
        s.prefix_cache = stats.prefix_cache
