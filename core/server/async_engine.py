"""The async front end: requests arrive and leave at any time while one background thread steps the
engine.

    engine thread:  loop { apply queued adds / aborts; step(); hand each request its new tokens }
    asyncio side:   stream = await front.submit(prompt, params); async for delta in stream: ...

Only the engine thread touches the `EngineCore` (the scheduler is not thread-safe): `submit` and
`abort` queue commands that the thread applies between steps, and the thread hands each request's
new tokens to its asyncio queue with `loop.call_soon_threadsafe`. Leaving a stream early (client
disconnect, timeout) aborts the request, which frees its cache slot and blocks at the next step
boundary. Back-pressure: at most `max_pending` requests are accepted and unfinished; `submit`
raises `QueueFull` beyond that (HTTP 429). Shutdown: `drain` refuses new requests, gives the open
ones a grace period, then aborts the rest, ending each stream with an error.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from deepinfer.engine.engine_core import EngineCore
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.engine_loop import Delta, EngineLoop, EngineSnapshot
from deepinfer.server.metrics import LatencyObserver

__all__ = ["AsyncEngine", "Delta", "EngineDead", "EngineSnapshot", "FrontEnd", "QueueFull", "RequestStream",
           "SHUT_DOWN"]

logger = logging.getLogger("deepinfer")

#: finish reason of a request the server aborted because it shuts down (HTTP 503)
SHUT_DOWN = "abort"
#: how often `drain` looks whether the open requests have finished
DRAIN_POLL_S = 0.05


class QueueFull(Exception):
    """More requests are pending than `max_pending`; retry after `retry_after` seconds."""

    def __init__(self, pending: int, retry_after: int):
        super().__init__(f"the server is at its limit of {pending} pending requests; retry after "
                         f"{retry_after} s")
        self.retry_after = retry_after


class EngineDead(RuntimeError):
    """The engine thread stopped (a failed step, or shutdown)."""


class RequestStream:
    """One request's deltas, as an async iterator. The first delta (no tokens) says the request was
    admitted, or is already the final one with the admission error."""

    def __init__(self, front: FrontEnd, request_id: str):
        self.front = front
        self.request_id = request_id
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.finished = False
        self.submitted = time.monotonic()
        self.last_token: dict[int, float] = {}  # sample index -> when its last tokens arrived

    async def next(self, timeout: float | None = None) -> Delta:
        delta = await asyncio.wait_for(self.queue.get(), timeout)
        if delta.done:
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


class FrontEnd:
    """What the HTTP app talks to, and the part both front ends share: the open streams (on the
    event loop), back-pressure, and delivery of deltas from another thread. `AsyncEngine` steps one
    engine in this process; `DPEngine` (dp_engine.py) routes over one engine process per
    data-parallel rank."""

    def __init__(self, max_pending: int):
        self.max_pending = max_pending
        self.snapshot = EngineSnapshot()
        #: per-request latencies (time to first token, between tokens, end to end, in the queue),
        #: observed as deltas reach their streams (the app points it at /metrics' histograms)
        self.latency: LatencyObserver = LatencyObserver()
        self.dead: str | None = None  # why no request can be served any more
        self._streams: dict[str, tuple[RequestStream, asyncio.AbstractEventLoop]] = {}  # loop side
        self._ids = itertools.count()

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: about one recent request's decode time."""
        mean = self.snapshot.step_seconds.mean or 0.1
        return max(1, round(mean * 16))

    async def submit(self, prompt: Any, params: SamplingParams, prefix: str = "req",
                     request_id: str | None = None) -> RequestStream:
        """Queue a request (its engine id `request_id`, else `prefix` and a number) and open its stream."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        if len(self._streams) >= self.max_pending:
            raise QueueFull(self.max_pending, self.retry_after())
        rid = request_id or f"{prefix}-{next(self._ids)}"
        stream = RequestStream(self, rid)
        stream.submitted = time.monotonic()
        self._streams[rid] = (stream, asyncio.get_running_loop())
        try:
            self._send_add(rid, prompt, params)
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._send_abort(request_id)

    async def drain(self, grace_s: float) -> int:
        """Shut down on the event loop: refuse new requests (503, /health too), give the open ones
        `grace_s` seconds to finish, then abort the rest in the engine and end each of their streams
        with finish reason "abort" and an error saying why. Returns how many were aborted."""
        if self.dead is None:
            self.dead = "the server is shutting down"
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        while self._streams and loop.time() < end:
            await asyncio.sleep(DRAIN_POLL_S)
        left = list(self._streams)
        if left:
            logger.warning("shutting down: aborting %d request(s) still running after %g s", len(left), grace_s)
        message = f"the server shut down before this request finished (it waited {grace_s:g} s); retry"
        for rid in left:
            self._send_abort(rid)
            self._deliver(rid, Delta([], finished=True, finish_reason=SHUT_DOWN, error=message))
        return len(left)

    def health(self) -> dict[str, Any]:
        """The /health body (only asked while `dead` is None)."""
        return {"status": "ok"}

    def labelled_gauges(self) -> dict[str, tuple[str, dict[str, float]]]:
        """Extra /metrics gauges with labels: name -> (help, {label text: value})."""
        return {}

    def shutdown(self) -> None:
        raise NotImplementedError

    def _send_add(self, rid: str, prompt: Any, params: SamplingParams) -> None:
        raise NotImplementedError

    def _send_abort(self, rid: str) -> None:
        raise NotImplementedError

    def _deliver(self, rid: str, delta: Delta) -> None:
        """Runs on the event loop."""
        entry = self._streams.get(rid)
        if entry is None:
            return  # aborted meanwhile
        self.latency.observe(entry[0], delta)
        if delta.done:
            del self._streams[rid]
            self._finished(rid, delta)
        entry[0].queue.put_nowait(delta)

    def _finished(self, rid: str, delta: Delta) -> None:
        """On the event loop, once per request that ended by itself (not aborted)."""

    def _post(self, rid: str, delta: Delta) -> None:
        """From any thread: hand `delta` to its stream's event loop."""
        entry = self._streams.get(rid)
        if entry is not None:
            entry[1].call_soon_threadsafe(self._deliver, rid, delta)


class AsyncEngine(FrontEnd):
    def __init__(self, engine: EngineCore, *, max_pending: int = 256, idle_wait_s: float = 0.5):
        super().__init__(max_pending)
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._cv = threading.Condition()
        self._commands: list[tuple[str, Any]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    def _send_add(self, rid: str, prompt: Any, params: SamplingParams) -> None:
        self._command("add", (rid, prompt, params))

    def _send_abort(self, rid: str) -> None:
        self._command("abort", rid)

    def _command(self, kind: str, payload: Any) -> None:
        with self._cv:
            self._commands.append((kind, payload))
            self._cv.notify()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # -- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        loop = EngineLoop(self.engine, self._post, self.snapshot)
        try:
            while True:
                with self._cv:
                    while not self._stop and not self._commands and not loop.busy:
                        self._cv.wait(self.idle_wait_s)
                    if self._stop:
                        return
                    commands, self._commands = self._commands, []
                loop.run_once(commands)
        except BaseException as e:  # a failed step: every open request ends with a generic error
            logger.exception("the engine step loop failed; the server stops accepting requests")
            self.dead = f"the engine failed ({type(e).__name__}); see the server log"
            loop.fail_all(self.dead)
