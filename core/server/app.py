"""The OpenAI-compatible HTTP app (FastAPI): routes, API-key check, limits, errors, SSE streaming.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses`, `POST
/v1/messages`, `GET /v1/models` and `/v1/models/{id}`, `POST /tokenize` and `/detokenize`,
`GET /tokenizer_info`, `GET /version`, `GET /health`, `GET /metrics`. Every answer carries an
`X-Request-Id` header (the client's, else a new one); response ids are random. Every answer that is
not a success, on every path (unknown routes and methods included), is an OpenAI error object (`{"error": {"message", "type", ...}}`): a 4xx status naming
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
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from deepinfer.engine.cache_manager import PrefixCacheStats
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.async_engine import SHUT_DOWN, Delta, EngineDead, FrontEnd, QueueFull, RequestStream
from deepinfer.server.chat_format import ChatFormat, ChatOutput, RequestError
from deepinfer.server.completions import PromptChoices, completion_params
from deepinfer.server.engine_loop import UNAVAILABLE
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.protocol import (CompletionChoice, CompletionRequest, CompletionResponse, DetokenizeRequest,
                                       ModelCard, ModelList, ServerSettings, TokenizeRequest, Usage, error_body,
                                       validation_message)
from deepinfer.server.request_body import BodyTimeout, read_json
from deepinfer.server.streams import Streams
from deepinfer.version import __version__

logger = logging.getLogger("deepinfer")

#: how often a non-streaming request checks whether its client is still there
DISCONNECT_POLL_S = 0.25
OPEN_ROUTES = ("/health",)  # reachable without the API key
#: the status /metrics counts for a request whose client went away before its answer (nginx's)
CLIENT_CLOSED = 499
OTHER_ROUTES = "other"  # the metrics label of every path that is not a route


class ClientGone(Exception):
    """The client disconnected before its answer."""


def response_id(prefix: str) -> str:
    """A response id no restart repeats (OpenAI's form: `chatcmpl-...`, `cmpl-...`)."""
    return f"{prefix}-{uuid.uuid4().hex}"


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
        request_id = _request_id(scope)

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
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
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        anthropic = headers.get(b"x-api-key")  # the Anthropic SDK's header (/v1/messages)
        # compare_digest is constant-time for inputs of equal length
        return ((scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key))
                or (anthropic is not None and hmac.compare_digest(anthropic.strip(), self.key)))


#: the longest X-Request-Id a client may set (a longer or non-printable one is replaced)
MAX_REQUEST_ID = 128


def _request_id(scope: dict) -> bytes:
    """The client's `X-Request-Id` (echoed, as vLLM does), else a new random one."""
    given = dict(scope["headers"]).get(b"x-request-id", b"")
    if 0 < len(given) <= MAX_REQUEST_ID and all(33 <= c < 127 for c in given):
        return given
    return uuid.uuid4().hex.encode()


def build_app(front: FrontEnd, chat: ChatFormat, settings: ServerSettings, *, served_model_name: str,
              max_model_len: int, tokenizer: Any) -> FastAPI:
    metrics = ServerMetrics()
    front.snapshot.step_seconds = metrics.step_time  # the engine thread observes into /metrics' histogram
    front.latency = metrics.latency  # per-request latencies into /metrics' histograms
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

    def check_prompt(n: int, where: str = "") -> None:
        if n > max_prompt:
            raise RequestError(400, f"{where}the prompt has {n} tokens, more than this server's limit of {max_prompt}")

    def parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
        try:
            return model.model_validate(body)
        except ValidationError as e:
            raise RequestError(400, validation_message(e)) from None

    async def start(prompts: list[list[int]], params: SamplingParams, rid: str) -> Streams:
        """Queue one engine request per prompt (engine id: the response id `rid`, and the prompt's
        index in a batch) and wait for their admission; an admission error is a 400 (naming the
        prompt in a batch), and the others are aborted."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                engine_id = rid if len(prompts) == 1 else f"{rid}-{i}"
                streams.append(await front.submit(prompt, params, request_id=engine_id))
            firsts = [await s.next(settings.request_timeout_s) for s in streams]
        except BaseException as e:  # timed out, the queue is full, or the handler was cancelled (client gone)
            for s in streams:
                s.abort()
            if isinstance(e, asyncio.TimeoutError):
                raise timeout_error() from None
            raise
        failed = next(((i, d) for i, d in enumerate(firsts) if d.done), None)
        if failed is not None:
            i, first = failed
            for s in streams:
                s.abort()
            metrics.tokens(0, 0, first.finish_reason)
            if first.finish_reason in (UNAVAILABLE, SHUT_DOWN):
                raise finish_error(first)
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise RequestError(400, where + (first.error or f"the request finished at admission "
                                                            f"({first.finish_reason})"))
        return Streams(streams)

    async def next_delta(streams: Streams, deadline: float) -> tuple[int, Delta]:
        """The next (prompt index, delta); TimeoutError past the deadline."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise TimeoutError
        try:
            return await streams.next(remaining)
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

    def sse(data: str, event: str | None = None) -> str:
        return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"

    def timeout_error() -> RequestError:
        return RequestError(504, f"the request did not finish within {settings.request_timeout_s:g} s", "timeout")

    def count(delta: Delta) -> None:
        """A sample's last delta: its tokens, and its prompt's once (with the request's last delta)."""
        metrics.tokens(delta.num_prompt_tokens if delta.done else 0, 0, delta.finish_reason)

    async def run_to_end(streams: Streams, request: Request, on_delta: Callable[[int, Delta], Any]) -> None:
        """Collect non-streaming requests; a failed sample is its error (the others are aborted),
        and a timeout or a disconnect aborts them all. Whether the client is still there is checked
        every DISCONNECT_POLL_S seconds, tokens arriving or not (a streaming response is cancelled
        by the server instead)."""
        loop = asyncio.get_running_loop()
        end = deadline()
        check_at = loop.time() + DISCONNECT_POLL_S
        try:
            while not streams.finished:
                if loop.time() >= check_at:
                    if await request.is_disconnected():
                        raise ClientGone
                    check_at = loop.time() + DISCONNECT_POLL_S
                try:
                    index, delta = await next_delta(streams, min(end, check_at))
                except TimeoutError:
                    if loop.time() >= end:
                        raise timeout_error() from None
                    continue
                metrics.tokens(0, len(delta.token_ids), None)
                on_delta(index, delta)
                if delta.finished:
                    count(delta)
                    error = finish_error(delta)
                    if error is not None:
                        raise error
        finally:
            if streams.abort():  # timed out, failed, or the client went away
                metrics.tokens(0, 0, "abort")

    async def sse_events(streams: Streams, on_delta: Callable[[int, Delta], list[str]],
                         on_end: Callable[[], list[str]], on_close: Callable[[], None] = lambda: None,
                         done: str | None = "[DONE]", error_event: str | None = None) -> AsyncIterator[str]:
        """A streaming response: `on_delta` turns each delta into SSE data (`(event, data)` pairs are
        named events), `on_end` gives the last events once every request finished (a usage chunk),
        then `done` (OpenAI's `[DONE]`; None: nothing). A timeout, a failed generation, a shutdown or
        an unexpected error ends the stream with an error object; leaving early (client gone: the
        server cancels this generator) aborts the requests."""
        end = deadline()

        def event(item: str | tuple[str, str]) -> str:
            return sse(item[1], item[0]) if isinstance(item, tuple) else sse(item)

        try:
            while not streams.finished:
                try:
                    index, delta = await next_delta(streams, end)
                except TimeoutError:
                    yield sse(json.dumps(error_body(timeout_error().message, "timeout")), error_event)
                    return
                metrics.tokens(0, len(delta.token_ids), None)
                if delta.finished:
                    count(delta)
                    error = finish_error(delta)
                    if error is not None:
                        yield sse(json.dumps(error_body(error.message, error.kind)), error_event)
                        return
                for item in on_delta(index, delta):
                    yield event(item)
            for item in on_end():
                yield event(item)
            if done is not None:
                yield sse(done)
        except Exception:  # a bug: the answer has begun, so it ends with an error event
            logger.exception("streaming request %s failed", streams.streams[0].request_id)
            yield sse(json.dumps(error_body("internal server error", "internal_error")), error_event)
        finally:
            if streams.abort():  # a no-op once finished
                metrics.tokens(0, 0, "abort")
            on_close()

    def check_model(model: Any) -> None:
        if model != served_model_name:
            raise RequestError(404, f"model {model!r} is not served here; use {served_model_name!r}",
                               "model_not_found")

    def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)

    def encode_text(text: str, add_bos: bool = True) -> list[int]:
        try:
            return tokenizer.encode(text, add_bos=add_bos)
        except ValueError as e:  # a model served without a tokenizer
            raise RequestError(400, str(e)) from None

    # -- routes -----------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        if front.dead is not None:
            return JSONResponse(error_body(front.dead, "unavailable"), status_code=503)
        return JSONResponse(front.health())

    model_card = ModelCard(id=served_model_name, created=created, max_model_len=max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        check_model(model_id)
        return model_card

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        """The tokenizer's special tokens (vLLM's route; lm-evaluation-harness's remote tokenizer reads it)."""
        from deepinfer.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN

        if not getattr(tokenizer, "has_text", False):
            raise RequestError(404, "this model is served without a tokenizer", "not_found")
        return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN,
                             "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "model_max_length": max_model_len,
                             "vocab_size": tokenizer.vocab_size})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        req = parse(TokenizeRequest, await read_body(request))
        if req.model is not None:
            check_model(req.model)
        if req.messages is not None:
            body = {"model": served_model_name, "messages": req.messages}
            tokens = chat.prepare(body).prompt_token_ids
        else:
            tokens = encode_text(req.prompt, add_bos=req.add_special_tokens)
        out: dict[str, Any] = {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}
        if req.return_token_strs:
            out["token_strs"] = [tokenizer.id_to_token(t) for t in tokens]
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = parse(DetokenizeRequest, await read_body(request))
        if req.model is not None:
            check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise RequestError(400, f"tokens {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})")
        return JSONResponse({"prompt": tokenizer.decode(req.tokens)})

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
        req = parse(CompletionRequest, await read_body(request))
        check_model(req.model)
        prompts = [encode_text(p) if isinstance(p, str) else p for p in req.prompts]
        for i, p in enumerate(prompts):
            check_prompt(len(p), f"prompt {i}: " if len(prompts) > 1 else "")
        try:
            params = completion_params(req)
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        rid = response_id("cmpl")
        streams = await start(prompts, params, rid)
        texts = [p if isinstance(p, str) else tokenizer.decode(p) if req.echo else "" for p in req.prompts]
        groups = [PromptChoices(req, params, ids, text, tokenizer, i * req.n)
                  for i, (ids, text) in enumerate(zip(prompts, texts))]
        n_prompt = sum(len(p) for p in prompts)
        created_at = int(time.time())

        def chunk(choices: list[CompletionChoice], use: Usage | None = None) -> str:
            return CompletionResponse(id=rid, created=created_at, model=served_model_name, choices=choices,
                                      usage=use).model_dump_json()

        if not req.stream:
            await run_to_end(streams, request, lambda i, d: groups[i].add(d))
            choices = [c for g in groups for c in g.choices()]
            out = CompletionResponse(id=rid, created=created_at, model=served_model_name, choices=choices,
                                     usage=usage(n_prompt, sum(g.num_generated for g in groups)))
            return JSONResponse(out.model_dump())

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def on_delta(i: int, delta: Delta) -> list[str]:
            groups[i].add(delta)
            if delta.finished:
                return [chunk([groups[i].stream_end(delta)])]
            piece = groups[i].stream_piece(delta) if delta.token_ids else None
            return [chunk([piece])] if piece is not None else []

        def on_end() -> list[str]:  # OpenAI's usage chunk: no choices
            return [chunk([], usage(n_prompt, sum(g.num_generated for g in groups)))] if include_usage else []

        return StreamingResponse(sse_events(streams, on_delta, on_end), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request)
        prepared = chat.prepare(body)
        n_prompt = len(prepared.prompt_token_ids)
        check_prompt(n_prompt)
        rid = response_id("chatcmpl")
        streams = await start([prepared.prompt_token_ids], prepared.params, rid)
        outs = [chat.output(prepared, rid, tokenizer, index=j) for j in range(prepared.params.num_samples)]

        def close() -> None:
            for out in outs:
                out.close()

        if not prepared.stream:
            def on_delta(_: int, delta: Delta) -> None:
                outs[delta.index].push_delta(delta)
                if delta.finished:
                    outs[delta.index].finish(delta.finish_reason)
            try:
                await run_to_end(streams, request, on_delta)
                return JSONResponse(chat_response(outs))
            finally:
                close()

        def on_delta(_: int, delta: Delta) -> list[str]:
            out = outs[delta.index]
            return out.push_delta(delta) + (out.finish(delta.finish_reason) if delta.finished else [])

        def on_end() -> list[str]:
            if not prepared.include_usage:
                return []
            return [outs[0].usage_chunk(sum(len(o.token_ids) for o in outs))]

        return StreamingResponse(sse_events(streams, on_delta, on_end, close), media_type="text/event-stream")

    async def recipe_protocol(protocol: str, request: Request) -> Response:
        """/v1/responses and /v1/messages: the recipe converts the request and writes the answer."""
        body = await read_body(request)
        check_model(body.get("model"))
        prepared = chat.prepare_protocol(protocol, body)
        check_prompt(len(prepared.prompt_token_ids))
        rid = response_id("resp" if protocol == "responses" else "msg")
        streams = await start([prepared.prompt_token_ids], prepared.params, rid)
        out = chat.output(prepared, rid, tokenizer)
        if not prepared.stream:
            def on_delta(_: int, delta: Delta) -> None:
                out.push_delta(delta)
                if delta.finished:
                    out.finish(delta.finish_reason)
            try:
                await run_to_end(streams, request, on_delta)
                return JSONResponse(out.response_dict())
            finally:
                out.close()

        def on_event(_: int, delta: Delta) -> list[tuple[str, str]]:
            return out.push_delta(delta) + (out.finish(delta.finish_reason) if delta.finished else [])

        return StreamingResponse(sse_events(streams, on_event, list, out.close, done=None, error_event="error"),
                                 media_type="text/event-stream")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await recipe_protocol("responses", request)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await recipe_protocol("messages", request)

    def chat_response(outs: list[ChatOutput]) -> dict[str, Any]:
        """One response with every sample's choice, usage over all of them."""
        data = outs[0].response_dict()
        data["choices"] = [o.choice() for o in outs]
        generated = sum(len(o.token_ids) for o in outs)
        data["usage"].update(completion_tokens=generated, total_tokens=data["usage"]["prompt_tokens"] + generated)
        return data

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
