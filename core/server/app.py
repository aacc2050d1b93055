"""The OpenAI-compatible HTTP app (FastAPI): routes, API-key check, limits, errors, SSE streaming.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`,
`GET /metrics`. Every answer that is not a success, on every path (unknown routes and methods
included), is an OpenAI error object (`{"error": {"message", "type", ...}}`): a 4xx status naming
the problem, 429 with `Retry-After` when the queue is full, 503 while the engine is down or the
server shuts down, 504 on a request timeout. An unexpected exception is logged and answered with a
bare 500 (never a stack trace) on a connection that stays usable.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from deepinfer.engine.cache_manager import PrefixCacheStats
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.async_engine import SHUT_DOWN, Delta, EngineDead, FrontEnd, QueueFull, RequestStream
from deepinfer.server.chat_format import ChatFormat, RequestError
from deepinfer.server.engine_loop import UNAVAILABLE
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.protocol import (CompletionChoice, CompletionRequest, CompletionResponse, ModelCard,
                                       ModelList, ServerSettings, Usage, error_body, validation_message)
from deepinfer.server.request_body import BodyTimeout, read_json

logger = logging.getLogger("deepinfer")

#: how often a non-streaming request checks whether its client is still there
DISCONNECT_POLL_S = 0.25
OPEN_ROUTES = ("/health",)  # reachable without the API key
#: the status /metrics counts for a request whose client went away before its answer (nginx's)
CLIENT_CLOSED = 499
OTHER_ROUTES = "other"  # the metrics label of every path that is not a route


class ClientGone(Exception):
    """The client disconnected before its answer."""


class GuardMiddleware:
    """Pure ASGI (so streaming and disconnects pass through untouched): checks the API key on every
    route but /health, in constant time; answers an unexpected exception with a 500 error object
    (logged, and the connection stays usable, as Starlette's own handler would drop it); counts
    answers by route and status: a route under its path, any other path under "other" (so random
    paths add no series), a client that went away as status 499."""

    def __init__(self, app: Any, api_key: str | None, metrics: ServerMetrics, routes: frozenset[str]):
        self.app = app
        self.key = None if api_key is None else api_key.encode()
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else OTHER_ROUTES
        status: list[int | None] = [None]

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.key is not None and scope["path"] not in OPEN_ROUTES and not self._authorised(scope):
                response = JSONResponse(error_body("invalid or missing API key; send 'Authorization: Bearer <key>'",
                                                   "authentication_error", code="invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, counting_send)
            await self.app(scope, receive, counting_send)
        except ClientGone:
            status[0] = CLIENT_CLOSED  # nobody to answer; the request was aborted
        except Exception:
            if status[0] is not None:  # the answer has begun: only closing the connection ends it
                raise
            logger.exception("unhandled error while serving %s %s", scope["method"], scope["path"])
            response = JSONResponse(error_body("internal server error", "internal_error"), status_code=500)
            await response(scope, receive, counting_send)
        finally:
            self.metrics.request_done(route, status[0] or 500)

    def _authorised(self, scope: dict) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        # compare_digest on equal-length inputs is constant-time; hashing would work too
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


def build_app(front: FrontEnd, chat: ChatFormat, settings: ServerSettings, *, served_model_name: str,
              max_model_len: int, tokenizer: Any) -> FastAPI:
    metrics = ServerMetrics()
    front.snapshot.step_seconds = metrics.step_time  # the engine thread observes into /metrics' histogram
    # the engine's rule (vLLM's): a prompt and at least one generated token fit in max_model_len
    max_prompt = min(settings.max_prompt_tokens or max_model_len - 1, max_model_len - 1)
    created = int(time.time())
    app = FastAPI(title="deepinfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front, app.state.metrics, app.state.chat = front, metrics, chat

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError) -> JSONResponse:
        # the rest of a body that did not arrive would be read as the next request: close instead
        headers = {"Connection": "close"} if isinstance(e, BodyTimeout) else None
        return JSONResponse(error_body(e.message, e.kind), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def _no_route(request: Request, e: HTTPException) -> JSONResponse:
        """Starlette's 404 (no such route) and 405 (the route takes another method), as OpenAI errors
        (`routes` is set at the end of build_app, once every route is registered)."""
        path = request.url.path[:200]
        if e.status_code == 404:
            message, code = (f"there is no route {request.method} {path}; the routes are "
                             f"{', '.join(sorted(routes))}"), "not_found"
        elif e.status_code == 405:
            allowed = (e.headers or {}).get("Allow", "")
            message, code = f"{path} does not take {request.method}; use {allowed}", "method_not_allowed"
        else:
            message, code = str(e.detail), None
        return JSONResponse(error_body(message, code=code), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(QueueFull)
    async def _queue_full(_: Request, e: QueueFull) -> JSONResponse:
        return JSONResponse(error_body(str(e), "rate_limit_error", code="queue_full"), status_code=429,
                            headers={"Retry-After": str(e.retry_after)})

    @app.exception_handler(EngineDead)
    async def _dead(_: Request, e: EngineDead) -> JSONResponse:
        return JSONResponse(error_body(str(e), "unavailable"), status_code=503)

    # -- helpers ----------------------------------------------------------------------------------

    async def read_body(request: Request) -> dict[str, Any]:
        return await read_json(request, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)

    def check_prompt(n: int) -> None:
        if n > max_prompt:
            raise RequestError(400, f"the prompt has {n} tokens, more than this server's limit of {max_prompt}")

    async def start(prompt: list[int], params: SamplingParams, prefix: str) -> RequestStream:
        """Queue the request and wait for its admission; an admission error is a 400."""
        stream = await front.submit(prompt, params, prefix)
        try:
            first = await stream.next(settings.request_timeout_s)
        except BaseException as e:  # timed out, or the handler was cancelled (client gone)
            stream.abort()
            if isinstance(e, asyncio.TimeoutError):
                raise timeout_error() from None
            raise
        if first.finished:
            metrics.tokens(0, 0, first.finish_reason)
            if first.finish_reason in (UNAVAILABLE, SHUT_DOWN):
                raise finish_error(first)
            raise RequestError(400, first.error or f"the request finished at admission ({first.finish_reason})")
        return stream

    async def next_delta(stream: RequestStream, deadline: float) -> Delta:
        """The stream's next delta; TimeoutError past the deadline."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise TimeoutError
        try:
            return await stream.next(remaining)
        except asyncio.TimeoutError:
            raise TimeoutError from None

    def deadline() -> float:
        return asyncio.get_running_loop().time() + settings.request_timeout_s

    def finish_error(delta: Delta) -> RequestError | None:
        if delta.finish_reason in ("stop", "length"):
            return None
        if delta.finish_reason in (UNAVAILABLE, SHUT_DOWN):  # its data-parallel rank went down, or shutdown
            return RequestError(503, delta.error or "the engine serving this request went down", "unavailable")
        return RequestError(400 if delta.finish_reason == "grammar_dead_end" else 500,
                            f"generation stopped: {delta.error or delta.finish_reason}",
                            "invalid_request_error" if delta.finish_reason == "grammar_dead_end" else "internal_error")

    def sse(data: str) -> str:
        return f"data: {data}\n\n"

    def timeout_error() -> RequestError:
        return RequestError(504, f"the request did not finish within {settings.request_timeout_s:g} s", "timeout")

    async def run_to_end(stream: RequestStream, request: Request, on_delta: Any) -> Delta:
        """Collect a non-streaming request; aborts it on timeout or disconnect. Whether the client is
        still there is checked every DISCONNECT_POLL_S seconds, tokens arriving or not (a streaming
        response is cancelled by the server instead)."""
        loop = asyncio.get_running_loop()
        end = deadline()
        check_at = loop.time() + DISCONNECT_POLL_S
        try:
            while True:
                if loop.time() >= check_at:
                    if await request.is_disconnected():
                        raise ClientGone
                    check_at = loop.time() + DISCONNECT_POLL_S
                try:
                    delta = await next_delta(stream, min(end, check_at))
                except TimeoutError:
                    if loop.time() >= end:
                        raise timeout_error() from None
                    continue
                on_delta(delta)
                if delta.finished:
                    return delta
        finally:
            if stream.abort():  # timed out, or the client went away
                metrics.tokens(0, 0, "abort")

    def count(stream_tokens: int, prompt_tokens: int, delta: Delta) -> None:
        metrics.tokens(prompt_tokens, stream_tokens, delta.finish_reason)

    async def sse_events(stream: RequestStream, n_prompt: int, on_tokens: Callable[[Delta], list[str]],
                         on_finish: Callable[[Delta], list[str]], on_close: Callable[[], None] = lambda: None
                         ) -> AsyncIterator[str]:
        """A streaming response: `on_tokens` / `on_finish` turn deltas into SSE data. A timeout, a
        failed generation, a shutdown or an unexpected error ends the stream with an error object;
        leaving early (client gone: the server cancels this generator) aborts the request."""
        end = deadline()
        n_tokens = 0
        try:
            while True:
                try:
                    delta = await next_delta(stream, end)
                except TimeoutError:
                    yield sse(json.dumps(error_body(timeout_error().message, "timeout")))
                    return
                n_tokens += len(delta.token_ids)
                if not delta.finished:
                    for data in on_tokens(delta):
                        yield sse(data)
                    continue
                count(n_tokens, n_prompt, delta)
                error = finish_error(delta)
                if error is not None:
                    yield sse(json.dumps(error_body(error.message, error.kind)))
                    return
                for data in on_finish(delta):
                    yield sse(data)
                yield sse("[DONE]")
                return
        except Exception:  # a bug: the answer has begun, so it ends with an error event
            logger.exception("streaming request %s failed", stream.request_id)
            yield sse(json.dumps(error_body("internal server error", "internal_error")))
        finally:
            if stream.abort():  # a no-op once finished
                metrics.tokens(0, 0, "abort")
            on_close()

    # -- routes -----------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        if front.dead is not None:
            return JSONResponse(error_body(front.dead, "unavailable"), status_code=503)
        return JSONResponse(front.health())

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, created=created, max_model_len=max_model_len)])

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        s = front.snapshot
        gauges = {"deepinfer_requests_waiting": (s.waiting, "requests queued in the scheduler"),
                  "deepinfer_requests_running": (s.running, "requests holding a cache slot"),
                  "deepinfer_requests_pending": (front.num_pending, "requests accepted by the server and not "
                                                                    "finished (the 429 limit applies to these)"),
                  "deepinfer_cache_usage": (s.cache_usage, "fraction of the scarcest cache resource in use"),
                  "deepinfer_cache_slots_used": (s.slots_used, "cache slots in use"),
                  "deepinfer_preemptions": (s.num_preemptions, "requests preempted since start"),
                  "deepinfer_engine_steps": (s.num_steps, "engine steps that ran a batch since start")}
        if s.prefix_cache is not None:
            gauges.update(prefix_cache_gauges(s.prefix_cache))
        return PlainTextResponse(metrics.render(gauges, front.labelled_gauges()), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request)
        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError as e:
            raise RequestError(400, validation_message(e)) from None
        if req.model != served_model_name:
            raise RequestError(404, f"model {req.model!r} is not served here; use {served_model_name!r}",
                               "model_not_found")
        if isinstance(req.prompt, str):
            try:
                prompt = tokenizer.encode(req.prompt, add_bos=True)
            except ValueError as e:
                raise RequestError(400, str(e)) from None
        else:
            prompt = req.prompt
        check_prompt(len(prompt))
        try:
            params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    stop=req.stop, seq_seed=req.seed,
                                    so_args=None if req.structured_outputs is None else req.structured_outputs.so_args())
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        stream = await start(prompt, params, "cmpl")
        rid, n_prompt = stream.request_id, len(prompt)
        tokens: list[int] = []

        def response(text: str, finish: str | None, usage: bool) -> CompletionResponse:
            return CompletionResponse(id=rid, model=served_model_name,
                                      choices=[CompletionChoice(text=text, finish_reason=finish)],
                                      usage=Usage(prompt_tokens=n_prompt, completion_tokens=len(tokens),
                                                  total_tokens=n_prompt + len(tokens)) if usage else None)

        if not req.stream:
            last = await run_to_end(stream, request, lambda d: tokens.extend(d.token_ids))
            count(len(tokens), n_prompt, last)
            error = finish_error(last)
            if error is not None:
                raise error
            return JSONResponse(response(last.text, last.finish_reason, True).model_dump())

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        holdback = max((len(s) for s in params.stop_strings), default=1) - 1  # a stop string may be forming
        decoder = tokenizer.stream_decoder(skip_special_tokens=params.skip_special_tokens)
        state = {"text": "", "sent": 0}

        def on_tokens(delta: Delta) -> list[str]:
            tokens.extend(delta.token_ids)
            state["text"] += decoder.push(delta.token_ids)
            safe = len(state["text"]) - holdback
            if safe <= state["sent"]:
                return []
            piece, state["sent"] = state["text"][state["sent"]:safe], safe
            return [response(piece, None, False).model_dump_json()]

        def on_finish(delta: Delta) -> list[str]:
            tokens.extend(delta.token_ids)
            # the final text has stop strings cut; what was sent is always a prefix of it
            return [response(delta.text[state["sent"]:], delta.finish_reason, include_usage).model_dump_json()]

        return StreamingResponse(sse_events(stream, n_prompt, on_tokens, on_finish), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request)
        prepared = chat.prepare(body)
        n_prompt = len(prepared.prompt_token_ids)
        check_prompt(n_prompt)
        stream = await start(prepared.prompt_token_ids, prepared.params, "chatcmpl")
        out = chat.output(prepared, stream.request_id, tokenizer)

        if not prepared.stream:
            try:
                last = await run_to_end(stream, request, out.push_delta)
                count(len(out.token_ids), n_prompt, last)
                error = finish_error(last)
                if error is not None:
                    raise error
                out.finish(last.finish_reason)
                return Response(out.response_json(), media_type="application/json")
            finally:
                out.close()

        def on_finish(delta: Delta) -> list[str]:
            return out.push(delta.token_ids) + out.finish(delta.finish_reason)

        return StreamingResponse(sse_events(stream, n_prompt, out.push_delta, on_finish, out.close),
                                 media_type="text/event-stream")

    routes = frozenset(route.path for route in app.routes)
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, metrics=metrics, routes=routes)
    return app


def prefix_cache_gauges(p: PrefixCacheStats) -> dict[str, tuple[float, str]]:
    """The prefix cache's counters for /metrics (`deepinfer serve --prefix-cache`)."""
    return {"deepinfer_prefix_cache_hits": (p.hits, "admissions that restored a cached prefix since start"),
            "deepinfer_prefix_cache_misses": (p.misses, "admissions that found no cached prefix since start"),
            "deepinfer_prefix_cache_hit_rate": (p.hit_rate, "hits / (hits + misses)"),
            "deepinfer_prefix_cache_evictions": (p.evictions, "cached blocks evicted since start (LRU)"),
            "deepinfer_prefix_cache_prefill_tokens_saved": (p.prefill_tokens_saved,
                                                            "prompt tokens restored instead of computed"),
            "deepinfer_prefix_cache_prefill_tokens": (p.prefill_tokens_total, "prompt tokens of admissions"),
            "deepinfer_prefix_cache_blocks": (p.blocks, "cached blocks"),
            "deepinfer_prefix_cache_bytes": (p.bytes_used, "host bytes the cached blocks hold"),
            "deepinfer_prefix_cache_capacity_bytes": (p.bytes_capacity, "the prefix cache's capacity")}
