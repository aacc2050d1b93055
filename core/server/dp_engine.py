"""`deepinfer serve --dp N`: one HTTP front end over N engine processes, one per data-parallel rank.

    event loop:     submit -> Router picks a rank -> the rank's sender thread pipes ("add", ...)
    rank process:   dp_worker.serve_rank: apply commands, step, pipe back each step's deltas
    reader thread:  one per rank: deltas -> the requests' asyncio queues; gauges -> /metrics

The ranks are started by `deepinfer.parallel.launch.start_ranks` (devices, threads per rank, the
layout's rules). Routing is `router.Router`: the rank that has seen the longest block-aligned
prefix of the prompt, unless it is busier than the least loaded rank by more than the slack.
A disconnect or timeout aborts the request on the rank that holds it. A rank that dies (killed,
out of memory, a failed step) ends each of its open requests with finish reason "unavailable"
(HTTP 503), the router stops sending it work, and the other ranks keep serving; /health reports
"degraded", and turns 503 once no rank is left.

Only `--ep 1` runs here: under expert parallelism every rank must enter each MoE exchange together,
and this loop steps each rank on its own requests (see docs/server.md).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.parallel.launch import RankGroup, start_ranks
from deepinfer.parallel.layout import ParallelConfigError, ParallelLayout
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.async_engine import EngineDead, FrontEnd
from deepinfer.server.dp_worker import RankReady, RankStatus, serve_rank
from deepinfer.server.engine_loop import UNAVAILABLE, Delta
from deepinfer.server.router import NoRankAvailable, RankLoad, Route, Router, RouterConfig

logger = logging.getLogger("deepinfer")

START_POLL_S = 0.5
STOP_WAIT_S = 30.0
RECENT_ROUTES = 1024


class DataParallelServe(BaseModel):
    """`deepinfer serve --dp N --threads-per-rank T --dp-routing ... --dp-affinity-slack S`."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    layout: ParallelLayout
    accelerator: type  # the back end's Accelerator class, instantiated in each rank
    threads_per_rank: int | None = Field(None, ge=1)
    routing: RouterConfig = RouterConfig()


def check_servable(layout: ParallelLayout) -> None:
    """Refuse, before any process starts, a layout `deepinfer serve` cannot run (on top of
    `layout.check_runnable`)."""
    if layout.ep > 1:
        raise ParallelConfigError(
            f"{layout.describe()}: deepinfer serve runs data parallelism with --ep 1 only. Under expert "
            f"parallelism every rank must join each MoE exchange in lockstep, and the server steps each rank on "
            f"its own requests as they arrive; use --ep 1 --dp N (one full engine per rank), or the offline "
            f"example for expert parallelism")
    if layout.nodes > 1:
        raise ParallelConfigError(f"{layout.describe()}: deepinfer serve runs its ranks on one node; unset "
                                  f"WORLD_SIZE/RANK")


@dataclass
class Rank:
    """The front end's view of one rank (mutated under DPEngine._lock)."""

    index: int
    conn: Any
    outbox: queue.Queue = field(default_factory=queue.Queue)
    in_flight: dict[str, tuple[list[int], int]] = field(default_factory=dict)  # rid -> (prompt, load tokens)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # rid -> tokens generated so far
    status: RankStatus | None = None
    down: str | None = None  # why the rank is gone

    def load(self) -> RankLoad:
        return RankLoad(requests=len(self.in_flight), tokens=sum(t for _, t in self.in_flight.values()),
                        alive=self.down is None)


class DPEngine(FrontEnd):
    def __init__(self, engine_args: dict[str, Any], dp: DataParallelServe, *, max_pending: int = 256):
        super().__init__(max_pending)
        import torch.multiprocessing as mp

        check_servable(dp.layout)
        pipes = [mp.get_context("spawn").Pipe() for _ in dp.layout.local_ranks()]
        self.group: RankGroup = start_ranks(serve_rank, (engine_args,), dp.layout, dp.accelerator,
                                            dp.threads_per_rank, per_rank=[(child,) for _, child in pipes])
        for _, child in pipes:
            child.close()  # only the rank holds its end: the pipe closes when the rank dies
        self.ranks = [Rank(i, parent) for i, (parent, _) in enumerate(pipes)]
        self._lock = threading.Lock()
        self._owner: dict[str, Rank] = {}
        #: where the last requests went (request id -> Route), for the debug log and tests
        self.recent_routes: OrderedDict[str, Route] = OrderedDict()
        self._stopping = False
        try:
            readies = [self._wait_ready(r) for r in self.ranks]
        except BaseException:
            self.group.stop()
            raise
        self.info: RankReady = readies[0]
        self.router = Router(len(self.ranks), self.info.block_tokens, dp.routing)
        self._threads = []
        for rank in self.ranks:
            for fn, name in ((self._read, "reader"), (self._write, "sender")):
                t = threading.Thread(target=fn, args=(rank,), name=f"deepinfer-rank{rank.index}-{name}", daemon=True)
                t.start()
                self._threads.append(t)

    @property
    def pids(self) -> list[int]:
        return [self.group.procs[r].pid for r in sorted(self.group.procs)]

    def _wait_ready(self, rank: Rank) -> RankReady:
        """The rank's "ready" message, once its engine is built; RuntimeError with its error if it failed."""
        proc = self.group.procs[rank.index]  # one node: local index = global rank
        while not rank.conn.poll(START_POLL_S):
            if not proc.is_alive():
                break
        try:
            kind, ready = rank.conn.recv()
            assert kind == "ready", kind
            return ready
        except (EOFError, OSError):
            reason = self.group.failure(rank.index)
        logger.error("data-parallel rank %d failed to start:\n%s", rank.index, reason)
        last = reason.strip().splitlines()[-1] if reason.strip() else "no error reported"
        raise RuntimeError(f"data-parallel rank {rank.index} failed to start: {last}")

    # -- event loop side ------------------------------------------------------------------------

    def _send_add(self, rid: str, prompt: Any, params: SamplingParams) -> None:
        tokens = list(prompt) if isinstance(prompt, (list, tuple)) else []
        with self._lock:
            try:
                route = self.router.route(tokens, [r.load() for r in self.ranks])
            except NoRankAvailable:
                raise EngineDead(self.dead or "every data-parallel rank is down") from None
            self.recent_routes[rid] = route
            if len(self.recent_routes) > RECENT_ROUTES:
                self.recent_routes.popitem(last=False)
            rank = self.ranks[route.rank]
            rank.in_flight[rid] = (tokens, len(tokens) + (params.max_tokens or 0))
            rank.outputs[rid] = []
            self._owner[rid] = rank
        logger.debug("request %s -> rank %d (%s, %d blocks matched)", rid, *route)
        rank.outbox.put(("add", (rid, prompt, params)))

    def _send_abort(self, rid: str) -> None:
        with self._lock:
            rank = self._owner.pop(rid, None)
            if rank is None:
                return
            rank.in_flight.pop(rid, None)
            rank.outputs.pop(rid, None)
        rank.outbox.put(("abort", rid))

    def _finished(self, rid: str, delta: Delta) -> None:
        with self._lock:
            rank = self._owner.pop(rid, None)
            if rank is None:
                return
            prompt, _ = rank.in_flight.pop(rid, ([], 0))
            output = rank.outputs.pop(rid, [])
            if rank.down is None and delta.finish_reason in ("stop", "length"):
                self.router.remember(rank.index, prompt + output)  # the next turn starts with both

    # -- rank threads ---------------------------------------------------------------------------

    def _write(self, rank: Rank) -> None:
        while True:
            message = rank.outbox.get()
            if message is None:
                return
            try:
                rank.conn.send(message)
            except (OSError, ValueError):
                return  # the rank is gone; its reader reports it

    def _read(self, rank: Rank) -> None:
        while True:
            try:
                kind, deltas, status = rank.conn.recv()
            except (EOFError, OSError):
                self._rank_down(rank)
                return
            with self._lock:
                for rid, delta in deltas:
                    if delta.token_ids and delta.index == 0 and rid in rank.outputs:
                        rank.outputs[rid].extend(delta.token_ids)
                rank.status = status
                self._refresh_snapshot()
            if status.step_seconds is not None:
                self.snapshot.step_seconds.observe(status.step_seconds)
            for rid, delta in deltas:
                self._post(rid, delta)

    def _rank_down(self, rank: Rank) -> None:
        if self._stopping:
            return
        message = (f"data-parallel rank {rank.index} went down while serving this request; "
                   f"the other ranks still serve, retry")
        with self._lock:
            rank.down, rank.status = "went down", None
            self.router.forget(rank.index)
            self._refresh_snapshot()
            lost = list(rank.in_flight)
            rank.in_flight.clear()
            rank.outputs.clear()
            for rid in lost:
                self._owner.pop(rid, None)
            if all(r.down is not None for r in self.ranks):
                self.dead = "every data-parallel rank is down; see the server log"
        rank.outbox.put(None)
        for rid in lost:
            self._post(rid, Delta([], finished=True, finish_reason=UNAVAILABLE, error=message))
        reason = self.group.failure(rank.index)
        rank.down = reason.strip().splitlines()[-1] if reason.strip() else "went down"  # for /health
        logger.error("data-parallel rank %d went down (%d open requests failed with 503):\n%s", rank.index,
                     len(lost), reason)

    def _refresh_snapshot(self) -> None:
        """The whole server's gauges: sums over the ranks (cache usage: the fullest rank's)."""
        from deepinfer.engine.cache_manager import PrefixCacheStats

        statuses = [r.status for r in self.ranks if r.status is not None and r.down is None]
        s = self.snapshot
        s.waiting = sum(x.waiting for x in statuses)
        s.running = sum(x.running for x in statuses)
        s.cache_usage = max((x.cache_usage for x in statuses), default=0.0)
        s.slots_used = sum(x.slots_used for x in statuses)
        s.num_steps = sum(x.num_steps for x in statuses)
        s.num_preemptions = sum(x.num_preemptions for x in statuses)
        caches = [x.prefix_cache for x in statuses if x.prefix_cache is not None]
        s.prefix_cache = PrefixCacheStats(**{name: sum(getattr(c, name) for c in caches)
                                             for name in PrefixCacheStats.model_fields}) if caches else None

    # -- reports --------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        down = {str(r.index): r.down for r in self.ranks if r.down is not None}
        if not down:
            return {"status": "ok", "ranks": len(self.ranks)}
        return {"status": "degraded", "ranks": len(self.ranks), "ranks_down": down}

    def labelled_gauges(self) -> dict[str, tuple[str, dict[str, float]]]:
        with self._lock:
            loads = [r.load() for r in self.ranks]
            statuses = [r.status for r in self.ranks]
            counts, per_rank_total = dict(self.router.counts), dict(self.router.per_rank)

        def per_rank(value) -> dict[str, float]:
            return {f'rank="{i}"': value(i) for i in range(len(self.ranks))}

        out = {
            "deepinfer_rank_up": ("1 while the data-parallel rank serves, 0 once it went down",
                                  per_rank(lambda i: float(loads[i].alive))),
            "deepinfer_rank_requests_pending": ("requests routed to the rank and not finished",
                                                per_rank(lambda i: loads[i].requests)),
            "deepinfer_rank_requests_waiting": ("requests queued in the rank's scheduler",
                                                per_rank(lambda i: statuses[i].waiting if statuses[i] else 0)),
            "deepinfer_rank_requests_running": ("requests holding a cache slot on the rank",
                                                per_rank(lambda i: statuses[i].running if statuses[i] else 0)),
            "deepinfer_rank_cache_slots_used": ("cache slots in use on the rank",
                                                per_rank(lambda i: statuses[i].slots_used if statuses[i] else 0)),
            "deepinfer_rank_requests_total": ("requests routed to the rank since start",
                                              per_rank(lambda i: per_rank_total.get(i, 0))),
            "deepinfer_route_total": ("requests routed, by reason: affinity (to the rank that saw the longest "
                                      "prefix), overloaded (that rank was too busy: least loaded), load (no "
                                      "prefix seen: least loaded), round_robin",
                                      {f'reason="{k}"': counts.get(k, 0)
                                       for k in ("affinity", "overloaded", "load", "round_robin")}),
        }
        if any(s is not None and s.prefix_cache is not None for s in statuses):
            out["deepinfer_rank_prefix_cache_hits"] = (
                "admissions on the rank that restored a cached prefix",
                per_rank(lambda i: statuses[i].prefix_cache.hits if statuses[i] and statuses[i].prefix_cache else 0))
        return out

    def shutdown(self) -> None:
        self._stopping = True
        for rank in self.ranks:
            rank.outbox.put(("stop", None))
            rank.outbox.put(None)
        for proc in self.group.procs.values():
            proc.join(STOP_WAIT_S)
        self.group.stop()
        for rank in self.ranks:
            rank.conn.close()
