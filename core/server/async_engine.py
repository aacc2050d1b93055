"""The async front end: requests arrive and leave at any time while one background thread steps the
engine.

    engine thread:  loop { apply queued adds / aborts; step(); hand each request its new tokens }
    asyncio side:   stream = await front.submit(prompt, params); async for delta in stream: ...

Only the engine thread touches the `EngineCore` (the scheduler is not thread-safe): `submit` and
`abort` queue commands that the thread applies between steps, and the thread hands each request's
new tokens to its asyncio queue with `loop.call_soon_threadsafe`. Leaving a stream early (client
disconnect, timeout) aborts the request, which frees its cache slot and blocks at the next step
boundary. Back-pressure: at most `max_pending` requests are accepted and unfinished; `submit`
raises `QueueFull` beyond that (HTTP 429).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.cache_manager import PrefixCacheStats
from deepinfer.engine.engine_core import EngineCore
from deepinfer.engine.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.metrics import Histogram

logger = logging.getLogger("deepinfer")


class QueueFull(Exception):
    """More requests are pending than `max_pending`; retry after `retry_after` seconds."""

    def __init__(self, pending: int, retry_after: int):
        super().__init__(f"the server is at its limit of {pending} pending requests; retry after "
                         f"{retry_after} s")
        self.retry_after = retry_after


class EngineDead(RuntimeError):
    """The engine thread stopped (a failed step, or shutdown)."""


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
    """Engine gauges, refreshed by the engine thread after each step (read by /metrics)."""

    waiting: int = 0
    running: int = 0
    cache_usage: float = 0.0
    slots_used: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    prefix_cache: PrefixCacheStats | None = None  # the prefix_cache feature's counters (None: off)
    step_seconds: Histogram = field(default_factory=Histogram)


class RequestStream:
    """One request's deltas, as an async iterator. The first delta (no tokens) says the request was
    admitted, or is already the final one with the admission error."""

    def __init__(self, front: AsyncEngine, request_id: str):
        self.front = front
        self.request_id = request_id
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.finished = False

    async def next(self, timeout: float | None = None) -> Delta:
        delta = await asyncio.wait_for(self.queue.get(), timeout)
        if delta.finished:
            self.finished = True
        return delta

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Delta]:
        while not self.finished:
            yield await self.next()

    def abort(self) -> bool:
        """Stop the request if it is still running; True when it was (idempotent)."""
        if self.finished:
            return False
        self.finished = True
        self.front.abort(self.request_id)
        return True


class AsyncEngine:
    def __init__(self, engine: EngineCore, *, max_pending: int = 256, idle_wait_s: float = 0.5):
        self.engine = engine
        self.max_pending = max_pending
        self.idle_wait_s = idle_wait_s
        self.snapshot = EngineSnapshot()
        self._cv = threading.Condition()
        self._commands: list[tuple[str, Any]] = []
        self._streams: dict[str, tuple[RequestStream, asyncio.AbstractEventLoop]] = {}  # loop side
        self._tracked: dict[str, tuple[Request, int]] = {}  # engine thread: request, tokens handed out
        self._ids = itertools.count()
        self._stop = False
        self.dead: str | None = None
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    # -- asyncio side -----------------------------------------------------------------------------

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: about one recent request's decode time."""
        mean = self.snapshot.step_seconds.mean or 0.1
        return max(1, round(mean * 16))

    async def submit(self, prompt: Any, params: SamplingParams, prefix: str = "req") -> RequestStream:
        if self.dead is not None:
            raise EngineDead(self.dead)
        if len(self._streams) >= self.max_pending:
            raise QueueFull(self.max_pending, self.retry_after())
        rid = f"{prefix}-{next(self._ids)}"
        stream = RequestStream(self, rid)
        self._streams[rid] = (stream, asyncio.get_running_loop())
        self._command("add", (rid, prompt, params))
        return stream

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._command("abort", request_id)

    def _command(self, kind: str, payload: Any) -> None:
        with self._cv:
            self._commands.append((kind, payload))
            self._cv.notify()

    def _deliver(self, rid: str, delta: Delta) -> None:
        """Runs on the event loop."""
        entry = self._streams.get(rid)
        if entry is None:
            return  # aborted meanwhile
        if delta.finished:
            del self._streams[rid]
        entry[0].queue.put_nowait(delta)

    def _post(self, rid: str, delta: Delta) -> None:
        entry = self._streams.get(rid)
        if entry is not None:
            entry[1].call_soon_threadsafe(self._deliver, rid, delta)

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # -- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while not self._stop and not self._commands and not engine.has_unfinished():
                        self._cv.wait(self.idle_wait_s)
                    if self._stop:
                        return
                    commands, self._commands = self._commands, []
                self._apply(commands)
                if engine.has_unfinished():
                    start = time.perf_counter()
                    finished = engine.step()
                    self.snapshot.step_seconds.observe(time.perf_counter() - start)
                    self._hand_out(finished)
                self._refresh_snapshot()
        except BaseException as e:  # a failed step: every open request ends with a generic error
            logger.exception("the engine step loop failed; the server stops accepting requests")
            self.dead = f"the engine failed ({type(e).__name__}); see the server log"
            for rid in list(self._tracked):
                self._post(rid, Delta([], finished=True, finish_reason="error", error=self.dead))
            self._tracked.clear()

    def _apply(self, commands: list[tuple[str, Any]]) -> None:
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
                self._post(rid, Delta([], True, "error", "the server failed to admit this request"))
                continue
            if req.is_finished:  # refused at admission: the reason is the request's error
                self._post(rid, Delta([], True, req.finish_reason, req.error, req.text, req.num_prompt_tokens))
                continue
            self._tracked[rid] = (req, 0)
            self._post(rid, Delta([], num_prompt_tokens=req.num_prompt_tokens))
        if aborts:
            self.engine.abort(aborts)
            for rid in aborts:
                self._tracked.pop(rid, None)

    def _hand_out(self, finished: list[Request]) -> None:
        done = {r.request_id for r in finished}
        for rid, (req, sent) in list(self._tracked.items()):
            new = req.output_token_ids[sent:]
            if req.is_finished or rid in done:
                self._post(rid, Delta(list(new), True, req.finish_reason, req.error, req.text, req.num_prompt_tokens))
                del self._tracked[rid]
            elif new:
                self._post(rid, Delta(list(new), num_prompt_tokens=req.num_prompt_tokens))
                self._tracked[rid] = (req, sent + len(new))

    def _refresh_snapshot(self) -> None:
        s, engine = self.snapshot, self.engine
        stats = engine.stats()
        s.waiting, s.running = len(engine.scheduler.waiting), len(engine.scheduler.running)
        s.cache_usage, s.slots_used = stats.usage, stats.slots_used
        s.num_steps, s.num_preemptions = engine.num_steps, engine.scheduler.num_preemptions
        s.prefix_cache = stats.prefix_cache
