"""Start one process per rank, wire up the rendezvous, and end the whole launch when one rank fails.

Each rank is a `spawn`ed process. Its environment is set in the parent right before it starts, so
device visibility (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES: one device per rank, so each
DP rank's `cp` processes hold `cp` consecutive devices from DEVICE_OFFSET) holds before the child
imports torch or any back end. In the child the back end joins the process group
(`Collectives.init_process_group`: gloo, nccl or hccl) at tcp://MASTER_ADDR:MASTER_PORT, sets
`torch.set_num_threads(threads_per_rank)`, makes every EP and CP group of the layout (sub-groups
where there are several, `deepinfer.parallel.groups`) and installs this rank's expert-parallel
group (ep > 1) and context-parallel group (cp > 1) before `target` builds its engine.

Several nodes: each node's parent starts and collects only its own ranks. So that node 0 can
report the whole run, every rank's value is gathered to global rank 0 when `target` returns (over
gloo, `gather_values`), and node 0's `launch`/`collect` returns every rank's value in the world;
the other nodes get their own ranks' values.

Failure: a rank that raises reports its traceback to the parent, which stops every other rank of
this node and raises `RankFailed` with that rank's error; a rank that dies without a word (killed,
out of memory) is reported by its exit code. No rank is left waiting in a collective.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from pydantic import BaseModel, ConfigDict

from deepinfer.accelerator.interface import Accelerator
from deepinfer.parallel.groups import check_subgroups
from deepinfer.parallel.layout import ParallelConfigError, ParallelLayout, check_runnable, env_int

#: Device-visibility variable of each back end with devices (by entry-point name).
VISIBLE_DEVICES_VAR = {"nvidia": "CUDA_VISIBLE_DEVICES", "ascend": "ASCEND_RT_VISIBLE_DEVICES"}
POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 5.0


class RankFailed(RuntimeError):
    """One rank of a launch failed; `rank` and its `error` (traceback text or exit code), and
    `exception`, the exception the rank raised, when it could be sent back (None otherwise), so that
    a caller can tell a refusal raised on purpose from a crash."""

    def __init__(self, rank: int, error: str, exception: BaseException | None = None):
        super().__init__(f"rank {rank} failed:\n{error}")
        self.rank, self.error, self.exception = rank, error, exception


def _error_report(e: BaseException) -> tuple[str, bytes | None]:
    """(traceback text, the pickled exception or None if it does not pickle) of a failed rank."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        return text, pickle.dumps(e.with_traceback(None))
    except Exception:  # noqa: BLE001 - an exception that does not pickle is reported by its text alone
        return text, None


def _rank_failed(rank: int, report: tuple[str, bytes | None]) -> RankFailed:
    text, pickled = report
    try:
        exception = pickle.loads(pickled) if pickled is not None else None
    except Exception:  # noqa: BLE001 - e.g. a constructor that needs other arguments than its args
        exception = None
    return RankFailed(rank, text, exception)


class RankContext(BaseModel):
    """What a rank's `target` is told about its place in the launch."""

    model_config = ConfigDict(frozen=True)

    rank: int  # global rank in the world (dp x cp)
    local_rank: int  # index among this node's ranks
    layout: ParallelLayout
    threads: int

    @property
    def dp_rank(self) -> int:
        return self.rank // self.layout.cp

    @property
    def is_first(self) -> bool:
        return self.rank == 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rendezvous(layout: ParallelLayout, env: dict[str, str] | None = None) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT; on one node they default to 127.0.0.1 and a free port."""
    env = dict(os.environ) if env is None else env
    addr = env.get("MASTER_ADDR", "").strip()
    port = env.get("MASTER_PORT", "").strip()
    if layout.nodes > 1 and not (addr and port):
        raise ParallelConfigError(f"{layout.nodes} nodes (WORLD_SIZE={layout.nodes}) need MASTER_ADDR and "
                                  f"MASTER_PORT set to node 0's address and a free port on every node")
    return addr or "127.0.0.1", env_int(env, "MASTER_PORT", 0, 1) if port else free_port()


def device_count(accelerator: type[Accelerator]) -> int | None:
    """Devices the back end's probe says this process may use; None when it does not say (the CPU)."""
    devices = accelerator.probe().details.get("devices", "")
    return int(devices) if devices.isdigit() else None


def check_devices(layout: ParallelLayout, accelerator: str, available: int | None,
                  env: dict[str, str] | None = None) -> None:
    """Refuse, before any process starts, a layout whose ranks need more devices than this node has
    (each of this node's DP ranks takes `cp` devices from DEVICE_OFFSET)."""
    if accelerator not in VISIBLE_DEVICES_VAR or available is None or layout.is_single:
        return
    env = dict(os.environ) if env is None else env
    offset = env_int(env, "DEVICE_OFFSET", 0, 0)
    needed = offset + layout.dp_per_node * layout.cp
    if needed > available:
        raise ParallelConfigError(
            f"{layout.describe()}: this node's {layout.dp_per_node} rank(s) x cp {layout.cp} need devices "
            f"{offset}..{needed - 1} (DEVICE_OFFSET={offset}), but the {accelerator} back end sees {available}; "
            f"choose a smaller layout (--ep/--dp/--cp; --ep 1 runs one process on one device) or more devices")


def default_threads(layout: ParallelLayout) -> int:
    """Cores divided among this node's ranks (at least 1)."""
    return max((os.cpu_count() or 1) // len(layout.local_ranks()), 1)


def rank_environment(accelerator: str, layout: ParallelLayout, local_rank: int,
                     env: dict[str, str] | None = None) -> dict[str, str]:
    """Variables a rank's process starts with: its device, DEVICE_OFFSET + local rank. A DP rank is
    `cp` processes (one per CP rank, consecutive), so it holds `cp` consecutive devices. When the
    parent's visibility variable lists devices (CUDA_VISIBLE_DEVICES=4,5,6,7) that index counts in
    that list, as the back end's device count does; otherwise it is the device's own number."""
    env = dict(os.environ) if env is None else env
    out: dict[str, str] = {}
    var = VISIBLE_DEVICES_VAR.get(accelerator)
    if var:
        index = env_int(env, "DEVICE_OFFSET", 0, 0) + local_rank
        visible = [d.strip() for d in env.get(var, "").split(",") if d.strip()]
        out[var] = visible[index] if index < len(visible) else str(index)
    return out


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_main(ctx: RankContext, accelerator: type[Accelerator], init_method: str, target: Callable[..., Any],
               args: tuple, results) -> None:
    try:
        import torch

        torch.set_num_threads(ctx.threads)
        from deepinfer.parallel.expert_parallel import join_world

        join_world(accelerator(), ctx.rank, ctx.layout, init_method)
        values = gather_values(ctx, target(ctx, *args))
        # pickled here, by value: torch's queue would pass tensors as shared memory that vanishes
        # when this process exits, possibly before the parent has read them
        results.put((ctx.rank, "ok", pickle.dumps(values)))
    except BaseException as e:  # noqa: BLE001 - everything goes to the parent, which ends the launch
        results.put((ctx.rank, "error", _error_report(e)))
        raise SystemExit(1) from None
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is already reported; a teardown hiccup is not a failure
        pass


def gather_values(ctx: RankContext, value: Any) -> dict[int, Any]:
    """{rank: value} this rank reports to its node's parent: its own value, and on global rank 0 of
    a launch over several nodes every rank's (gathered to it over a gloo group, whatever the back
    end's collective backend, so no device is involved)."""
    if ctx.layout.nodes == 1:
        return {ctx.rank: value}
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(f"{ctx.layout.describe()} spans several nodes, but this back end did not join a "
                           f"torch.distributed process group, so node 0 cannot gather the other nodes' results")
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    gathered: list[Any] | None = [None] * ctx.layout.world_size if ctx.rank == 0 else None
    dist.gather_object(value, gathered, dst=0, group=group)
    return dict(enumerate(gathered)) if gathered is not None else {ctx.rank: value}


class RankGroup:
    """This node's rank processes, started by `start_ranks`: `procs` by global rank, and the queue
    on which each reports (rank, "ok", pickled {rank: value}, see `gather_values`) or (rank, "error",
    (traceback text, pickled exception or None)) when it ends."""

    def __init__(self, procs: dict[int, Any], results: Any):
        self.procs, self.results = procs, results

    def collect(self) -> list[Any]:
        """Wait for every rank of this node; their values in rank order (on node 0 of several nodes:
        every rank's of the world); RankFailed as soon as one fails."""
        return _collect(self.procs, self.results)

    def failure(self, rank: int, wait_s: float = STOP_GRACE_SECONDS) -> str:
        """Why `rank` ended: its traceback if it reported one within `wait_s`, else its exit code."""
        proc = self.procs[rank]
        proc.join(wait_s)
        try:
            while True:
                who, status, value = self.results.get(timeout=POLL_SECONDS)
                if who == rank and status == "error":
                    return value[0]
        except queue_module.Empty:
            pass
        return f"process exited with code {proc.exitcode} without reporting an error" if proc.exitcode is not None \
            else "process stopped answering"

    def stop(self) -> None:
        _stop(self.procs.values())


def start_ranks(target: Callable[..., Any], args: tuple, layout: ParallelLayout, accelerator: type[Accelerator],
                threads_per_rank: int | None = None, per_rank: Sequence[tuple] | None = None) -> RankGroup:
    """Spawn one process per rank of this node running `target(RankContext, *args, *per_rank[i])`
    (i: the local rank) and return without waiting. `target`, `args` and `per_rank` must be
    picklable; per-rank arguments carry what only one rank may hold (a pipe end)."""
    check_runnable(layout)
    check_subgroups(layout, accelerator, accelerator.name)
    check_devices(layout, accelerator.name, device_count(accelerator))
    threads = _threads(layout, threads_per_rank)
    ranks = list(layout.local_ranks())
    if per_rank is not None and len(per_rank) != len(ranks):
        raise ValueError(f"{len(per_rank)} per-rank argument tuples for {len(ranks)} ranks on this node")
    addr, port = rendezvous(layout)
    init_method = f"tcp://{addr}:{port}"

    import torch.multiprocessing as mp

    mp_ctx = mp.get_context("spawn")
    group = RankGroup({}, mp_ctx.Queue())
    try:
        for local_rank, rank in enumerate(ranks):
            ctx = RankContext(rank=rank, local_rank=local_rank, layout=layout, threads=threads)
            rank_args = args + (per_rank[local_rank] if per_rank is not None else ())
            proc = mp_ctx.Process(target=_rank_main, args=(ctx, accelerator, init_method, target, rank_args,
                                                           group.results),
                                  name=f"deepinfer-rank{rank}", daemon=False)
            with _environ(rank_environment(accelerator.name, layout, local_rank)):
                proc.start()  # a spawned child takes the environment as it is now
            group.procs[rank] = proc
    except BaseException:
        group.stop()
        raise
    return group


def _threads(layout: ParallelLayout, threads_per_rank: int | None) -> int:
    if threads_per_rank is not None and threads_per_rank < 1:
        raise ParallelConfigError(f"--threads_per_rank {threads_per_rank} must be >= 1")
    return threads_per_rank or default_threads(layout)


def launch(target: Callable[..., Any], args: tuple, layout: ParallelLayout, accelerator: type[Accelerator],
           threads_per_rank: int | None = None) -> list[Any]:
    """Run `target(RankContext, *args)` once per rank of this node; returns their values in rank order
    (on node 0 of a launch over several nodes: every rank's of the world, see the module docstring).

    One rank (world size 1) runs in this process. Otherwise every rank is a spawned process and
    `target` and `args` must be picklable (a module-level function); `accelerator` is the back
    end's class (`deepinfer.plugins.select_accelerator_class`), instantiated in each rank. Raises `RankFailed` as soon as
    a rank fails, after stopping the others."""
    check_runnable(layout)
    threads = _threads(layout, threads_per_rank)
    if layout.is_single:
        return [target(RankContext(rank=0, local_rank=0, layout=layout, threads=threads), *args)]
    group = start_ranks(target, args, layout, accelerator, threads)
    try:
        return group.collect()
    finally:
        group.stop()


def _collect(procs: dict[int, Any], results) -> list[Any]:
    values: dict[int, Any] = {}  # rank -> value: a rank reports its own, node 0's first rank every rank's
    reported: set[int] = set()
    while len(reported) < len(procs):
        try:
            rank, status, value = results.get(timeout=POLL_SECONDS)
        except queue_module.Empty:
            for rank, proc in procs.items():  # died without reporting (killed, segfault, out of memory)
                if rank not in reported and proc.exitcode is not None and not _reported_late(results, values,
                                                                                              reported):
                    raise RankFailed(rank, f"process exited with code {proc.exitcode} without reporting a result")
            continue
        _record(rank, status, value, values, reported)
    for proc in procs.values():
        proc.join(STOP_GRACE_SECONDS)
    return [values[r] for r in sorted(values)]


def _record(rank: int, status: str, value: Any, values: dict[int, Any], reported: set[int]) -> None:
    if status == "error":
        raise _rank_failed(rank, value)
    values.update(pickle.loads(value))
    reported.add(rank)


def _reported_late(results, values: dict[int, Any], reported: set[int]) -> bool:
    """A rank may exit right after putting its result: drain what arrived before calling it lost."""
    try:
        rank, status, value = results.get(timeout=POLL_SECONDS)
    except queue_module.Empty:
        return False
    _record(rank, status, value, values, reported)
    return True


def _stop(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(STOP_GRACE_SECONDS)
        if proc.is_alive():
            proc.kill()
            proc.join()
