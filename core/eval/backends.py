"""Where samples are generated: the offline engine, or any OpenAI-compatible chat endpoint.

Both take the same Chat Completions bodies (`chat_body`) and give back `Completion`s read from a
Chat Completions response (`Completion.from_response`). The offline back end renders and parses
with the server's own deepseek-recipe adapter (`deepinfer.server.chat_format.ChatFormat`), so a
body run offline and the same body sent to `deepinfer serve` give the same text, reasoning and
token counts. Only the plain fields every such endpoint knows are sent (model, messages,
max_tokens, temperature, top_p, seed, stream false), plus `thinking` and `reasoning_effort`
(DeepSeek's switches) and whatever `extra_body` adds.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, Iterable, Iterator

from pydantic import BaseModel, ConfigDict, Field

#: HTTP statuses an endpoint may answer while busy or restarting: tried again after a pause
RETRY_STATUSES = (408, 429, 500, 502, 503, 504)


class SamplingSettings(BaseModel):
    """The generation settings of a run (part of its fingerprint). Defaults: DeepSeek's published
    V4.1 settings (temperature 1.0, top_p 0.95), thinking on at high effort; `max_tokens` None lets
    the engine or endpoint give each sample what the context leaves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    thinking: bool = True
    reasoning_effort: str | None = "high"
    extra_body: dict[str, Any] = Field(default_factory=dict)


def chat_body(model: str, messages: list[dict[str, Any]], seed: int, s: SamplingSettings) -> dict[str, Any]:
    """The Chat Completions body of one sample."""
    body: dict[str, Any] = {"model": model, "messages": messages, "temperature": s.temperature, "top_p": s.top_p,
                            "seed": seed, "stream": False, "thinking": {"type": "enabled" if s.thinking else "disabled"}}
    if s.max_tokens is not None:
        body["max_tokens"] = s.max_tokens
    if s.thinking and s.reasoning_effort:
        body["reasoning_effort"] = s.reasoning_effort
    body.update(s.extra_body)
    return body


class Completion(BaseModel):
    """One sample's answer: `text` (after the reasoning), `reasoning`, how it ended, token counts;
    or `error` when the request failed."""

    text: str = ""
    reasoning: str | None = None
    finish_reason: str = "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @classmethod
    def from_response(cls, response: dict[str, Any]) -> Completion:
        """From a Chat Completions response (`reasoning_content`, as DeepSeek's API and deepinfer
        serve name it, or `reasoning`, as some servers do)."""
        try:
            choice = response["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            return cls(error=f"not a chat completion response: {json.dumps(response)[:300]}")
        usage = response.get("usage") or {}
        return cls(text=message.get("content") or "", reasoning=message.get("reasoning_content", message.get("reasoning")),
                   finish_reason=choice.get("finish_reason") or "stop", prompt_tokens=usage.get("prompt_tokens") or 0,
                   completion_tokens=usage.get("completion_tokens") or 0)

    @classmethod
    def failed(cls, message: str) -> Completion:
        return cls(error=message)


# -- an OpenAI-compatible endpoint ---------------------------------------------------------------

class EndpointError(RuntimeError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class Endpoint:
    """A client of an OpenAI-compatible server at `base_url` (".../v1"), standard library only.
    Busy or failing answers (`RETRY_STATUSES`, connection errors) are tried `retries` more times
    with a growing pause; any other error is an `EndpointError` with the server's message."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 3600.0, retries: int = 5):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.retries = retries

    def _request(self, method: str, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.base_url + route, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                detail = _error_message(e.read())
                if e.code not in RETRY_STATUSES or attempt == self.retries:
                    raise EndpointError(f"{method} {self.base_url}{route}: HTTP {e.code}: {detail}", e.code) from None
            except (urllib.error.URLError, OSError) as e:
                if attempt == self.retries:
                    raise EndpointError(f"{method} {self.base_url}{route}: {getattr(e, 'reason', e)}") from None
            time.sleep(min(2.0 ** attempt, 30.0))
        raise AssertionError("unreachable")

    def models(self) -> list[dict[str, Any]]:
        return list(self._request("GET", "/models").get("data") or [])

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", "/chat/completions", body)

    def default_model(self) -> str:
        """The one model the endpoint serves (the first listed); an error when it lists none."""
        models = self.models()
        if not models:
            raise EndpointError(f"{self.base_url}/models lists no model; name one with --served-model")
        return str(models[0]["id"])


def _error_message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except Exception:
        return raw.decode("utf-8", "replace")[:500]


class EndpointBackend:
    """Samples from an endpoint, `concurrency` requests in flight."""

    def __init__(self, endpoint: Endpoint, model: str, concurrency: int = 16):
        if concurrency < 1:
            raise ValueError(f"--concurrency {concurrency} must be >= 1")
        self.endpoint, self.model, self.concurrency = endpoint, model, concurrency

    def describe(self) -> dict[str, Any]:
        listed = next((m for m in self.endpoint.models() if m.get("id") == self.model), {})
        return {"backend": "endpoint", "url": self.endpoint.base_url, "model": self.model,
                "model_card": {k: v for k, v in listed.items() if k not in ("created",)}}

    def _one(self, body: dict[str, Any]) -> Completion:
        try:
            return Completion.from_response(self.endpoint.chat(body))
        except EndpointError as e:
            return Completion.failed(str(e))

    def run(self, requests: Iterable[tuple[str, dict[str, Any]]]) -> Iterator[tuple[str, Completion]]:
        """(request id, completion) for each (request id, body), as they finish."""
        todo = iter(requests)
        pool = ThreadPoolExecutor(self.concurrency)
        running: dict[Any, str] = {}
        try:
            while True:
                for rid, body in todo:
                    running[pool.submit(self._one, body)] = rid
                    if len(running) >= self.concurrency:
                        break
                if not running:
                    return
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    yield running.pop(future), future.result()
        finally:  # interrupted: do not wait for the requests in flight
            pool.shutdown(wait=False, cancel_futures=True)


# -- the offline engine --------------------------------------------------------------------------

class OfflineBackend:
    """Samples from an offline engine (`deepinfer.LLM`), every request queued at once so that the
    scheduler batches them continuously; each completion is handed back as its request finishes."""

    def __init__(self, llm: Any, served_model_name: str):
        from deepinfer.server.chat_format import ChatFormat, tokenizer_file

        self.llm = llm
        self.model = served_model_name
        self.chat = ChatFormat(model_type=llm.build_info.model_type, tokenizer_file=tokenizer_file(llm.tokenizer),
                               served_model_name=served_model_name, max_model_len=llm.engine.max_model_len)
        if self.chat.unavailable is not None:
            raise ValueError(f"cannot render the benchmark's chat prompts for this model: {self.chat.unavailable}")

    def run(self, requests: Iterable[tuple[str, dict[str, Any]]]) -> Iterator[tuple[str, Completion]]:
        from deepinfer.server.chat_format import RequestError

        engine = self.llm.engine
        pending: dict[str, Any] = {}
        try:
            for rid, body in requests:
                try:
                    prepared = self.chat.prepare(body)
                except RequestError as e:
                    yield rid, Completion.failed(e.message)
                    continue
                request = engine.add_request({"prompt_token_ids": prepared.prompt_token_ids}, prepared.params,
                                             request_id=rid)
                if request.is_finished:  # refused at admission
                    yield rid, self._completion(prepared, request.to_output())
                else:
                    pending[rid] = prepared
            while pending:
                for request in engine.step():
                    prepared = pending.pop(request.request_id, None)
                    if prepared is not None:
                        yield request.request_id, self._completion(prepared, request.to_output())
        finally:
            if pending:  # interrupted: nothing of this run is left in the engine
                engine.abort_all()

    def _completion(self, prepared: Any, output: Any) -> Completion:
        c = output.outputs[0]
        if output.error is not None or c.finish_reason in ("error", "abort", "grammar_dead_end"):
            return Completion.failed(output.error or f"the request ended with {c.finish_reason}")
        parser = self.chat.output(prepared, output.request_id, self.llm.tokenizer)
        try:
            parser.push(c.token_ids)
            parser.finish(c.finish_reason)
            return Completion.from_response(parser.response_dict())
        finally:
            parser.close()
