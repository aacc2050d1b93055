"""`deepinfer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine.

    deepinfer serve /ckpt                               # http://127.0.0.1:8000/v1 (or --model /ckpt)
    deepinfer serve --model /ckpt --api-key "$KEY"      # or DEEPINFER_API_KEY=...
    deepinfer serve --model /ckpt --host 0.0.0.0 --port 9000 --max-pending 64
    deepinfer serve --model /ckpt --prefix-cache --prefix-cache-dir ~/.cache/deepinfer/prefix
    deepinfer serve --model /ckpt --dp 2 --threads-per-rank 1 --prefix-cache   # one engine per rank, routed

Binds to 127.0.0.1 unless --host says otherwise (with a warning when that is not loopback and no
API key is set); an empty API key is refused. On SIGTERM or Ctrl-C it stops accepting connections,
gives the requests still running --shutdown-timeout seconds, then aborts them (their streams end
with an error event) and exits. Engine settings not exposed as flags go in a TOML file (--config).
See docs/server.md.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from deepinfer import envs

logger = logging.getLogger("deepinfer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer serve", description="OpenAI-compatible HTTP server.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory or Hugging Face id in the local cache (vLLM's form; or --model)")
    p.add_argument("--model", default=None, help="checkpoint directory or Hugging Face id in the local cache")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but "
                                                   "/health (default: DEEPINFER_API_KEY, else none); an empty "
                                                   "key is refused")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the "
                                                             "checkpoint folder's name)")
    p.add_argument("--max-pending", type=int, default=256, help="requests accepted and unfinished before "
                                                                "new ones get HTTP 429")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the engine's max_model_len - 1 (a prompt and one generated token must fit)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is aborted")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive (slower or shorter bodies get 408)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="on SIGTERM / Ctrl-C, seconds the running requests get before they are aborted")
    p.add_argument("--no-thinking", action="store_true",
                   help="chat requests that do not say otherwise run without thinking mode")
    p.add_argument("--accelerator", default=None)
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--no-async", action="store_true", help="disable the async batch pipeline")
    p.add_argument("--config", default=None, help="TOML engine configuration file")
    p.add_argument("--prefix-cache", action="store_true",
                   help="reuse the model state of prompt prefixes seen before (the prefix_cache feature)")
    p.add_argument("--prefix-cache-dir", default=None,
                   help="persist the prefix cache in this directory (loaded at start, written at shutdown; "
                        "implies --prefix-cache)")
    p.add_argument("--prefix-cache-mb", type=float, default=None,
                   help="host memory for the prefix cache in MiB (default 1024; implies --prefix-cache)")
    par = p.add_argument_group("data parallelism (docs/parallelism.md, docs/server.md)")
    par.add_argument("--dp", "--data-parallel-size", dest="dp", type=int, default=None,
                     help="data-parallel ranks: one engine process each behind this front end (default 1)")
    par.add_argument("--ep", type=int, default=1, help="expert parallelism; deepinfer serve runs --ep 1 only")
    par.add_argument("--threads-per-rank", "--threads_per_rank", dest="threads_per_rank", type=int, default=None,
                     help="CPU threads of each rank (default: the cores divided among the ranks)")
    par.add_argument("--dp-routing", choices=["affinity", "round_robin"], default="affinity",
                     help="affinity (default): the rank that has seen the longest prefix of the prompt, unless it "
                          "is busier than the least loaded rank by more than --dp-affinity-slack; round_robin")
    par.add_argument("--dp-affinity-slack", type=int, default=None,
                     help="requests in flight the affinity rank may have beyond the least loaded one (default 4)")
    return p


def data_parallel(args: argparse.Namespace) -> Any:
    """The `DataParallelServe` the --dp/--ep flags ask for, None for one in-process engine;
    ParallelConfigError names a layout that cannot be served."""
    from deepinfer.parallel.layout import ParallelConfigError, check_runnable, resolve_layout
    from deepinfer.plugins import select_accelerator_class
    from deepinfer.server.dp_engine import DataParallelServe, check_servable
    from deepinfer.server.router import RouterConfig

    accelerator = select_accelerator_class(args.accelerator)
    layout = resolve_layout(args.ep, args.dp, 1, accelerator.name)
    check_runnable(layout)
    check_servable(layout)
    if args.threads_per_rank is not None and args.threads_per_rank < 1:
        raise ParallelConfigError(f"--threads-per-rank {args.threads_per_rank} must be >= 1")
    if layout.is_single:
        return None
    routing = RouterConfig(policy=args.dp_routing, **({} if args.dp_affinity_slack is None
                                                      else {"slack": args.dp_affinity_slack}))
    return DataParallelServe(layout=layout, accelerator=accelerator, threads_per_rank=args.threads_per_rank,
                             routing=routing)


def prefix_cache_features(args: argparse.Namespace) -> dict[str, dict] | None:
    """The `features` table the --prefix-cache flags ask for (None: no flag given)."""
    if not (args.prefix_cache or args.prefix_cache_dir or args.prefix_cache_mb is not None):
        return None
    table: dict[str, Any] = {}
    if args.prefix_cache_dir:
        table["dir"] = str(Path(args.prefix_cache_dir).expanduser())
    if args.prefix_cache_mb is not None:
        table["capacity_mb"] = args.prefix_cache_mb
    return {"prefix_cache": table}


def _import_web() -> tuple[Any, Any]:
    try:
        import fastapi
        import uvicorn
    except ImportError as e:
        raise RuntimeError(f"deepinfer serve needs fastapi and uvicorn ({e}); install them with "
                           f"`pip install 'deepinfer[serve]'`") from None
    return fastapi, uvicorn


def build_server(settings: Any, dp: Any = None, **engine_args: Any) -> tuple[Any, Any]:
    """(FastAPI app, front end) for `settings` (a `ServerSettings`) and `LLM(...)` keyword
    arguments: an `AsyncEngine` over one engine in this process, or with `dp` (a
    `DataParallelServe`) a `DPEngine` over one engine process per rank. The caller runs the app and
    calls `front.shutdown()` afterwards."""
    _import_web()
    from deepinfer.server.app import build_app
    from deepinfer.server.chat_format import ChatFormat, import_recipe, tokenizer_file

    import_recipe()  # before the model loads: a missing package is a start-up error
    llm = None
    if dp is None:
        from deepinfer.llm import LLM
        from deepinfer.server.async_engine import AsyncEngine

        llm = LLM(**engine_args)
        engine = llm.engine
        model_path, model_type, max_model_len, tokenizer = (llm.build_info.model_path, llm.build_info.model_type,
                                                            engine.max_model_len, engine.tokenizer)
        front = AsyncEngine(engine, max_pending=settings.max_pending)
    else:
        from deepinfer.server.dp_engine import DPEngine

        front = DPEngine(engine_args, dp, max_pending=settings.max_pending)
        info = front.info
        model_path, model_type, max_model_len, tokenizer = (info.model_path, info.model_type, info.max_model_len,
                                                            info.tokenizer)
    name = settings.served_model_name or Path(model_path).name
    chat = ChatFormat(model_type=model_type, tokenizer_file=tokenizer_file(tokenizer), served_model_name=name,
                      max_model_len=max_model_len, default_thinking=settings.default_thinking)
    if chat.unavailable is not None:
        logger.warning("chat completions are unavailable: %s", chat.unavailable)
    app = build_app(front, chat, settings, served_model_name=name, max_model_len=max_model_len, tokenizer=tokenizer)
    app.state.llm = llm  # an LLM shuts its engine down when it is garbage-collected
    return app, front


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else DEEPINFER_API_KEY, else None. ValueError for an empty (or blank) value of
    either: it is almost always a deploy script's unset `$KEY`, and serving without authentication
    because of it would go unnoticed."""
    key, source = ((args.api_key, "--api-key") if args.api_key is not None
                   else (envs.get_verbatim("DEEPINFER_API_KEY"), "DEEPINFER_API_KEY"))
    if key is not None and not key.strip():
        raise ValueError(f"{source} is empty, and the server will not start without authentication by mistake; "
                         f"give a key, or leave both --api-key and DEEPINFER_API_KEY unset to serve without one")
    return key


def run(app: Any, front: Any, settings: Any, log_level: str) -> None:
    """Serve `app` until SIGTERM or Ctrl-C, then drain `front` (see `front.drain`)."""
    _, uvicorn = _import_web()

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            # uvicorn stops accepting and waits for the open connections; the drain ends the
            # requests still running after the grace period, so that wait ends
            drain = asyncio.ensure_future(front.drain(settings.shutdown_timeout_s))
            try:
                await super().shutdown(sockets)
            finally:
                if self.force_exit:  # a second Ctrl-C: do not wait for the grace period
                    drain.cancel()
                await asyncio.gather(drain, return_exceptions=True)

    # a backstop for connections the drain cannot end (a body still arriving)
    grace = settings.shutdown_timeout_s + settings.body_timeout_s
    server = DrainingServer(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                                           timeout_graceful_shutdown=grace))
    # uvicorn handles SIGTERM and SIGINT itself while it serves, then raises the signal again under
    # the handler found before; the default ones would kill the process (or raise KeyboardInterrupt)
    # before the engine shuts down and the prefix cache is persisted, so those handlers are no-ops
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}; give one")
        args.model = args.model_tag
    from deepinfer.server.protocol import ServerSettings

    try:
        level = envs.log_level("INFO")
    except ValueError as e:  # DEEPINFER_LOG_LEVEL=garbage
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = ServerSettings(host=args.host, port=args.port, api_key=api_key(args),
                                  served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                                  max_prompt_tokens=args.max_prompt_tokens, max_pending=args.max_pending,
                                  request_timeout_s=args.request_timeout, body_timeout_s=args.body_timeout,
                                  shutdown_timeout_s=args.shutdown_timeout, default_thinking=not args.no_thinking)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if settings.api_key is None and not _is_loopback(settings.host):
        logger.warning("binding to %s without an API key: anyone who can reach this address can use the "
                       "server; set --api-key or DEEPINFER_API_KEY", settings.host)
    try:
        dp = data_parallel(args)
    except (ValueError, RuntimeError) as e:  # ParallelConfigError; PluginError for an unusable --accelerator
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dp is None and args.threads_per_rank is not None:
        import torch

        torch.set_num_threads(args.threads_per_rank)
    engine_args = dict(model=args.model, accelerator=args.accelerator, dtype=args.dtype,
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, config=args.config,
                       async_pipeline=False if args.no_async else None, features=prefix_cache_features(args))
    try:
        app, front = build_server(settings, dp, **engine_args)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        run(app, front, settings, logging.getLevelName(level).lower())  # uvicorn's name of the same level
    finally:
        front.shutdown()
    return 0
