"""Several requests' streams read as one: a batch of completion prompts is one engine request per
prompt, and a route answers them together (`(prompt index, delta)` in arrival order)."""
from __future__ import annotations

import asyncio

from deepinfer.server.async_engine import RequestStream
from deepinfer.server.engine_loop import Delta


class Streams:
    def __init__(self, streams: list[RequestStream]):
        self.streams = streams
        self._queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        self._open = sum(not s.finished for s in streams)
        self._pumps = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams) if not s.finished]

    async def _pump(self, index: int, stream: RequestStream) -> None:
        while not stream.finished:
            self._queue.put_nowait((index, await stream.next()))

    async def next(self, timeout: float | None = None) -> tuple[int, Delta]:
        """The next delta of any stream, with the index of its stream; TimeoutError past `timeout`."""
        index, delta = await asyncio.wait_for(self._queue.get(), timeout)
        if delta.done:
            self._open -= 1
        return index, delta

    @property
    def finished(self) -> bool:
        return self._open == 0

    def abort(self) -> bool:
        """Stop every request still running; True when one was (idempotent)."""
        for pump in self._pumps:
            pump.cancel()
        return any([s.abort() for s in self.streams])
