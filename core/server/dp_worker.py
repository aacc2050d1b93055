"""One data-parallel rank of `deepinfer serve --dp N`: its own engine, stepped in its own process.

The front end (`dp_engine.py`) starts one of these per rank through `deepinfer.parallel.launch`
(so each rank gets the launcher's devices and thread pool) and talks to it over a pipe:

    front end -> rank:  ("add", (request_id, prompt, SamplingParams)) | ("abort", request_id) | ("stop", None)
    rank -> front end:  ("ready", RankReady), then ("deltas", [(request_id, Delta), ...], RankStatus)

The rank applies what arrived between steps and sends one message per step with every request's
new tokens and its gauges. It exits on "stop" or when the front end's end of the pipe closes; an
exception (a failed step) reaches the launcher, which reports its traceback to the front end.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from deepinfer.engine.cache_manager import PrefixCacheStats
from deepinfer.parallel.launch import RankContext
from deepinfer.server.engine_loop import Delta, EngineLoop, EngineSnapshot

#: how long an idle rank waits for a command before looking again
IDLE_WAIT_S = 0.5


class RankReady(BaseModel):
    """What a rank tells the front end once its engine is built."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model_path: str
    model_type: str | None
    max_model_len: int
    block_tokens: int | None  # the prefix cache's block (None: no prefix cache)
    tokenizer: Any  # the engine's tokenizer (picklable), so the front end never loads the model


class RankStatus(BaseModel):
    """A rank's gauges after a step, and the step's time."""

    waiting: int
    running: int
    cache_usage: float
    slots_used: int
    num_steps: int
    num_preemptions: int
    prefix_cache: PrefixCacheStats | None = None
    step_seconds: float | None = None


def rank_engine_args(engine_args: dict[str, Any], dp_rank: int) -> dict[str, Any]:
    """The rank's `LLM(...)` arguments: a persisted prefix cache gets a folder per rank (each rank
    has its own cache; two stores writing one folder would delete each other's files)."""
    from deepinfer.config import load_config

    config = load_config({k: v for k, v in engine_args.items() if k != "config"}, engine_args.get("config"))
    table = config.features.get("prefix_cache")
    if table and table.get("dir"):
        features = {**config.features, "prefix_cache": {**table, "dir": str(Path(table["dir"]) / f"rank{dp_rank}")}}
        config = config.model_copy(update={"features": features})
    return {"config": config}


def serve_rank(ctx: RankContext, engine_args: dict[str, Any], conn: Any) -> None:
    """The rank's process body (a `launch` target)."""
    import os
    import signal

    from deepinfer.llm import LLM

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end owns the rank's life (Ctrl-C stops it there)

    dir_var = "DEEPINFER_PREFIX_CACHE_DIR"  # the environment's folder, too, is per rank
    if os.environ.get(dir_var):
        os.environ[dir_var] = str(Path(os.environ[dir_var]) / f"rank{ctx.dp_rank}")
    llm = LLM(**rank_engine_args(engine_args, ctx.dp_rank))
    try:
        engine = llm.engine
        prefix = engine.cache.prefix_cache
        conn.send(("ready", RankReady(model_path=llm.build_info.model_path, model_type=llm.build_info.model_type,
                                      max_model_len=engine.max_model_len, tokenizer=engine.tokenizer,
                                      block_tokens=None if prefix is None else prefix.block_tokens)))
        _serve(EngineLoopOverPipe(engine), conn)
    finally:
        llm.shutdown()


class EngineLoopOverPipe(EngineLoop):
    """An `EngineLoop` whose deltas collect in `outbox` until the step's message is sent."""

    def __init__(self, engine: Any):
        self.outbox: list[tuple[str, Delta]] = []
        super().__init__(engine, lambda rid, delta: self.outbox.append((rid, delta)), EngineSnapshot())

    def status(self, seconds: float | None) -> RankStatus:
        s = self.snapshot
        return RankStatus(waiting=s.waiting, running=s.running, cache_usage=s.cache_usage, slots_used=s.slots_used,
                          num_steps=s.num_steps, num_preemptions=s.num_preemptions, prefix_cache=s.prefix_cache,
                          step_seconds=seconds)


def _serve(loop: EngineLoopOverPipe, conn: Any) -> None:
    while True:
        commands = []
        try:
            if conn.poll(0 if loop.busy else IDLE_WAIT_S):
                while conn.poll():
                    commands.append(conn.recv())
        except (EOFError, OSError):
            return  # the front end is gone
        if any(kind == "stop" for kind, _ in commands):
            return
        seconds = loop.run_once(commands)
        if commands or seconds is not None:
            out, loop.outbox = loop.outbox, []
            try:
                conn.send(("deltas", out, loop.status(seconds)))
            except (EOFError, OSError):
                return
