"""`deepinfer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine.

    deepinfer serve --model /ckpt                       # http://127.0.0.1:8000/v1
    deepinfer serve --model /ckpt --api-key "$KEY"      # or DEEPINFER_API_KEY=...
    deepinfer serve --model /ckpt --host 0.0.0.0 --port 9000 --max-pending 64
    deepinfer serve --model /ckpt --prefix-cache --prefix-cache-dir ~/.cache/deepinfer/prefix

Binds to 127.0.0.1 unless --host says otherwise (with a warning when that is not loopback and no
API key is set). Engine settings not exposed as flags go in a TOML file (--config). See
docs/server.md.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from pathlib import Path
from typing import Any

from deepinfer import envs

logger = logging.getLogger("deepinfer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer serve", description="OpenAI-compatible HTTP server.")
    p.add_argument("--model", default=None, help="checkpoint directory or Hugging Face id in the local cache")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but "
                                                   "/health (default: DEEPINFER_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the "
                                                             "checkpoint folder's name)")
    p.add_argument("--max-pending", type=int, default=256, help="requests accepted and unfinished before "
                                                                "new ones get HTTP 429")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the engine's max_model_len")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is aborted")
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
    return p


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


def build_server(settings: Any, **engine_args: Any) -> tuple[Any, Any]:
    """(FastAPI app, AsyncEngine) for `settings` (a `ServerSettings`) and `LLM(...)` keyword
    arguments. The caller runs the app and calls `front.shutdown()` afterwards."""
    _import_web()
    from deepinfer.llm import LLM
    from deepinfer.server.app import build_app
    from deepinfer.server.async_engine import AsyncEngine
    from deepinfer.server.chat_format import ChatFormat, import_recipe

    import_recipe()  # before the model loads: a missing package is a start-up error
    llm = LLM(**engine_args)
    engine, info = llm.engine, llm.build_info
    name = settings.served_model_name or Path(info.model_path).name
    tokenizer = engine.tokenizer
    chat = ChatFormat(model_type=info.model_type, tokenizer_file=getattr(tokenizer, "source", None)
                      if getattr(tokenizer, "has_text", False) else None, served_model_name=name,
                      max_model_len=engine.max_model_len, default_thinking=settings.default_thinking)
    if chat.unavailable is not None:
        logger.warning("chat completions are unavailable: %s", chat.unavailable)
    front = AsyncEngine(engine, max_pending=settings.max_pending)
    app = build_app(front, chat, settings, served_model_name=name, max_model_len=engine.max_model_len,
                    tokenizer=tokenizer)
    app.state.llm = llm  # an LLM shuts its engine down when it is garbage-collected
    return app, front


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from deepinfer.server.protocol import ServerSettings

    level = envs.get("DEEPINFER_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO), format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = ServerSettings(host=args.host, port=args.port, api_key=args.api_key or envs.get("DEEPINFER_API_KEY"),
                                  served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                                  max_prompt_tokens=args.max_prompt_tokens, max_pending=args.max_pending,
                                  request_timeout_s=args.request_timeout, default_thinking=not args.no_thinking)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if settings.api_key is None and not _is_loopback(settings.host):
        logger.warning("binding to %s without an API key: anyone who can reach this address can use the "
                       "server; set --api-key or DEEPINFER_API_KEY", settings.host)
    engine_args = dict(model=args.model, accelerator=args.accelerator, dtype=args.dtype,
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, config=args.config,
                       async_pipeline=False if args.no_async else None, features=prefix_cache_features(args))
    try:
        app, front = build_server(settings, **engine_args)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _, uvicorn = _import_web()
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=level.lower()
                    if level.lower() in ("critical", "error", "warning", "info", "debug") else "info")
    finally:
        front.shutdown()
    return 0
