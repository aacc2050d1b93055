"""`deepinfer serve` through the real `openai` client against a server on 127.0.0.1 (one per module):
chat, streaming, JSON schema, a parsed tool call, stop sequences, structured-output extensions, bad
requests (strict types, malformed bodies: always a 4xx, never a 500), errors that keep the connection
usable, unknown routes, the API key, disconnects, concurrency against the offline engine,
back-pressure, timeouts, and the real command's start-up checks and shutdown on SIGTERM.

The model is a tiny random DeepSeek-V4 (its cut-down real tokenizer keeps the chat control tokens),
so the text is gibberish; what is checked is the protocol, the constraints and the engine's
bookkeeping.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("deepseek_recipe")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # the HTTP client the openai package is built on

KEY = "test-key-1234"
ENGINE = dict(accelerator="cpu", dtype="float32", max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=512)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}]


class Server:
    def __init__(self, url: str, app, front, settings, model: str, path: str):
        self.url, self.app, self.front, self.settings, self.model, self.path = url, app, front, settings, model, path

    def client(self, key: str = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from deepinfer.entrypoints.serve import build_server
    from deepinfer.models.deepseek_v4.make_model import make_model
    from deepinfer.server.protocol import ServerSettings
    from server_harness import running_server

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = str(make_model(tmp_path_factory.mktemp("serve") / "tiny-v4", "tiny", seed=0, with_mtp=False,
                          max_position_embeddings=2048))
    settings = ServerSettings(api_key=KEY, default_thinking=False, max_pending=128, max_body_bytes=64 * 1024)
    app, front = build_server(settings, model=path, **ENGINE)
    with running_server(app, front) as url:
        yield Server(url, app, front, settings, "tiny-v4", path)
    torch.set_num_threads(threads)


def _idle(server: Server, timeout: float = 20.0) -> dict[str, float]:
    """Metrics once no request is pending, running or holding cache."""
    end = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["deepinfer_requests_pending"] == 0 and m["deepinfer_requests_running"] == 0 \
                and m["deepinfer_cache_slots_used"] == 0:
            return m
        assert time.monotonic() < end, f"requests still held: {m}"
        time.sleep(0.05)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- chat -----------------------------------------------------------------------------------------

def test_chat_completion_counts_usage_and_streams_the_same_text(server):
    client = server.client()
    out = client.chat.completions.create(model=server.model, messages=_user("Hello there"), max_tokens=8,
                                         temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str)
    prepared = server.app.state.chat.prepare({"model": server.model, "messages": _user("Hello there"),
                                              "max_tokens": 8})
    assert out.usage.prompt_tokens == len(prepared.prompt_token_ids)
    assert out.usage.completion_tokens == 8 and out.usage.total_tokens == out.usage.prompt_tokens + 8

    chunks = list(client.chat.completions.create(model=server.model, messages=_user("Hello there"), max_tokens=8,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    with_usage = list(client.chat.completions.create(model=server.model, messages=_user("Hello there"),
                                                     max_tokens=8, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
    assert [c.usage for c in with_usage if c.usage][-1].completion_tokens == 8


def test_json_schema_response_format_is_valid(server):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["color", "count"], "additionalProperties": False}
    out = server.client().chat.completions.create(
        model=server.model, messages=_user("Pick a colour, as JSON"), max_tokens=96, temperature=1, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    free = server.client().chat.completions.create(
        model=server.model, messages=_user("Any JSON object"), max_tokens=96, temperature=1, seed=5,
        response_format={"type": "json_object"})
    assert isinstance(json.loads(free.choices[0].message.content), dict)


def test_a_missing_deepseek_recipe_is_a_clear_start_up_error(monkeypatch):
    import sys

    from deepinfer.server.chat_format import import_recipe

    monkeypatch.setitem(sys.modules, "deepseek_recipe", None)  # what an uninstalled package looks like
    with pytest.raises(RuntimeError, match=r"deepseek-recipe.*pip install 'deepinfer\[serve\]'"):
        import_recipe()


def test_required_tool_call_is_parsed(server):
    out = server.client().chat.completions.create(
        model=server.model, messages=_user("What is the weather in Paris?"), tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=400, temperature=1, seed=3)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7


def test_structured_outputs_extension_regex_and_grammar(server):
    client = server.client()
    out = client.completions.create(model=server.model, prompt="code:", max_tokens=16, temperature=1, seed=1,
                                    extra_body={"structured_outputs": {"regex": "[a-c]{2}-[0-9]{2}"}})
    assert re.fullmatch("[a-c]{2}-[0-9]{2}", out.choices[0].text), out.choices[0].text
    chat = client.chat.completions.create(model=server.model, messages=_user("yes or no?"), max_tokens=16,
                                          temperature=1, seed=2,
                                          extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert chat.choices[0].message.content in ("yes", "no")


# -- stop sequences ---------------------------------------------------------------------------------

def _ascii_stop(text: str) -> tuple[str, int]:
    """A two-letter piece of `text` and where it first occurs (not at the very start)."""
    for k in range(1, len(text) - 1):
        piece = text[k:k + 2]
        if re.fullmatch("[A-Za-z]{2}", piece) and text.index(piece) == k:
            return piece, k
    raise AssertionError(f"no two-letter piece in {text!r}")


def test_stop_sequences_cut_the_text(server):
    client = server.client()
    free = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=24, temperature=0)
    stop, k = _ascii_stop(free.choices[0].text)
    cut = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=24, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == free.choices[0].text[:k]
    streamed = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=24,
                                         temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == free.choices[0].text[:k]

    chat_free = client.chat.completions.create(model=server.model, messages=_user("Tell a story"), max_tokens=24,
                                               temperature=0).choices[0].message.content
    stop, k = _ascii_stop(chat_free)
    chat_cut = client.chat.completions.create(model=server.model, messages=_user("Tell a story"), max_tokens=24,
                                              temperature=0, stop=stop).choices[0]
    assert chat_cut.finish_reason == "stop" and chat_cut.message.content == chat_free[:k]


# -- bad requests and security -----------------------------------------------------------------------

def test_invalid_requests_get_a_4xx_naming_the_problem(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=server.model, messages=_user("hi"), temperature=7)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=server.model, prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="regex"):  # refused at admission by the constraint
        client.completions.create(model=server.model, prompt="hi", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "([a-"}})
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="prompt has .* tokens"):
        client.completions.create(model=server.model, prompt=[5] * 3000, max_tokens=4)
    # a prompt of exactly max_model_len tokens leaves no room for one generated token: refused up front
    with pytest.raises(openai.BadRequestError, match="prompt has 2048 tokens, more than .* limit of 2047"):
        client.completions.create(model=server.model, prompt=[5] * 2048, max_tokens=4)
    auth = {"Authorization": f"Bearer {KEY}"}
    bad_json = httpx.post(server.url + "/v1/chat/completions", content=b"{oops", headers=auth)
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    big = httpx.post(server.url + "/v1/completions", headers=auth,
                     json={"model": server.model, "prompt": "x" * 70_000})
    assert big.status_code == 413 and "limit" in big.json()["error"]["message"]
    # the others are undisturbed, and nothing is left behind
    ok = client.completions.create(model=server.model, prompt="hi", max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length"
    _idle(server)


def test_api_key_is_required_except_on_health(server):
    with pytest.raises(openai.AuthenticationError, match="API key"):
        server.client(key="wrong-key").models.list()
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer"}).status_code == 401
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in server.client().models.list().data] == [server.model]


def test_an_internal_error_has_no_stack_trace(server, monkeypatch):
    chat = server.app.state.chat

    def broken(body):
        raise KeyError("secret internal detail")

    monkeypatch.setattr(chat, "prepare", broken)
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": server.model, "messages": _user("hi")})
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "internal server error", "type": "internal_error", "param": None,
                                  "code": "internal_error"}}


# -- bad input never gets a 500 ----------------------------------------------------------------------

def _post(server: Server, route: str, body: str | bytes) -> httpx.Response:
    data = body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass")
    return httpx.post(server.url + route, content=data, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})


def _chat_body(**fields) -> dict:
    return {"model": "tiny-v4", "messages": _user("hi"), "max_tokens": 2, **fields}


def _completion_body(**fields) -> dict:
    return {"model": "tiny-v4", "prompt": "hi", "max_tokens": 2, **fields}


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("route, body, expected", [
    # lax JSON types that used to be converted
    ("/v1/completions", _completion_body(prompt=[True, 5]), "prompt"),
    ("/v1/completions", _completion_body(stream="yes"), "stream: Input should be a valid boolean"),
    ("/v1/completions", _completion_body(temperature=True), "temperature: Input should be a valid number"),
    ("/v1/completions", _completion_body(max_tokens=True), "max_tokens: Input should be a valid integer"),
    ("/v1/completions", _completion_body(n=True), "n: Input should be a valid integer"),
    # types the chat route read itself, and answered with a 500
    ("/v1/chat/completions", _chat_body(stream=True, stream_options="yes"), "stream_options: Input should be"),
    ("/v1/chat/completions", _chat_body(stream=True, stream_options=[1]), "stream_options: Input should be"),
    ("/v1/chat/completions", _chat_body(seed=2**80), "seed: the integer 1208925819614629174706176 is outside"),
    ("/v1/chat/completions", _chat_body(max_tokens=2**80), "max_tokens: the integer"),
    ("/v1/chat/completions", _chat_body(seed=2**63), "seed"),  # the documented range is [0, 2^63)
    ("/v1/chat/completions", _chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "deep", "schema": _nested_schema(300)}}), "response_format.json_schema.schema.properties"),
], ids=["prompt-true", "stream-yes", "temperature-true", "max_tokens-true", "n-true", "stream_options-str",
        "stream_options-list", "chat-seed-2^80", "chat-max_tokens-2^80", "chat-seed-2^63", "schema-300-deep"])
def test_wrong_json_types_and_values_get_a_400_naming_the_field(server, route, body, expected):
    r = _post(server, route, json.dumps(body))
    assert r.status_code == 400, r.text
    assert expected in r.json()["error"]["message"]


@pytest.mark.parametrize("route, body, expected", [
    ("/v1/completions", "[" * 20_000 + "]" * 20_000, "nests deeper than 128 levels"),
    ("/v1/completions", '{"a": ' + "[" * 200 + "]" * 200 + "}", "a.0.0.0.0.0... (128 levels): the request body nests"),
    ("/v1/completions", '{"model": "tiny-v4", "prompt": "a\\ud800b"}',
     r"prompt: contains a lone surrogate ('\ud800') at character 1"),
    ("/v1/chat/completions", '{"model": "tiny-v4", "messages": [{"role": "user", "content": "\\udfff"}]}',
     r"messages.0.content: contains a lone surrogate ('\udfff') at character 0"),
    ("/v1/completions", '{"model": "tiny-v4", "prompt": "hi", "temperature": NaN}', "NaN is not a JSON number"),
], ids=["nested-20000", "nested-200", "surrogate-prompt", "surrogate-chat", "nan"])
def test_malformed_bodies_get_a_400_naming_the_problem(server, route, body, expected):
    r = _post(server, route, body)
    assert r.status_code == 400, r.text
    assert expected in r.json()["error"]["message"]


def _exchange(sock: socket.socket, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one HTTP/1.1 request on `sock` and read its answer (status, headers, body)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-answer"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _raw_request(route: str, body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return (f"POST {route} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode() + body


def test_a_500_answers_an_error_object_and_keeps_the_connection_usable(server, monkeypatch):
    def broken(body):
        raise KeyError("secret internal detail")

    monkeypatch.setattr(server.app.state.chat, "prepare", broken)
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        status, _, body = _exchange(sock, _raw_request("/v1/chat/completions", json.dumps(_chat_body()).encode()))
        assert status == 500 and json.loads(body)["error"]["message"] == "internal server error"
        # the next request on the same keep-alive connection is served
        status, _, body = _exchange(sock, _raw_request("/v1/completions", json.dumps(_completion_body()).encode()))
        assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length"


def test_an_error_inside_a_stream_ends_it_with_an_error_event(server, monkeypatch):
    from deepinfer.server.chat_format import ChatOutput

    def broken(self, delta):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(ChatOutput, "push_delta", broken)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=_chat_body(max_tokens=8, stream=True)) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-1]) == {"error": {"message": "internal server error", "type": "internal_error",
                                                    "param": None, "code": "internal_error"}}
        monkeypatch.undo()
        assert client.post("/v1/completions", json=_completion_body()).status_code == 200
    _idle(server)


def test_a_body_shorter_than_its_content_length_times_out_with_408(server, monkeypatch):
    monkeypatch.setattr(server.settings, "body_timeout_s", 0.5)
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        status, headers, body = _exchange(sock, _raw_request("/v1/completions", b'{"model"', content_length=100))
        assert status == 408 and headers["connection"] == "close"
        assert "did not arrive within 0.5 s (received 8 bytes of the 100 bytes" in json.loads(body)["error"]["message"]
        assert sock.recv(1) == b""  # closed: the rest of that body cannot be told from a next request


def test_unknown_routes_and_methods_get_openai_errors_and_share_one_metrics_label(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    missing = httpx.post(server.url + "/v1/embeddings", headers=auth, json={})
    assert missing.status_code == 404
    assert "no route POST /v1/embeddings" in missing.json()["error"]["message"]
    assert "/v1/chat/completions" in missing.json()["error"]["message"]
    wrong = httpx.get(server.url + "/v1/completions", headers=auth)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["message"] == "/v1/completions does not take GET; use POST"
    probes = [server.url + f"/v1/probe-{i}-{time.time_ns()}" for i in range(4)]  # random paths, without the key
    assert httpx.get(probes[0]).status_code == 401
    before = server.metrics()
    for url in probes[1:]:
        assert httpx.get(url).status_code == 401
    after = server.metrics()
    assert {k for k in after if k.startswith("deepinfer_requests_total")} == \
        {k for k in before if k.startswith("deepinfer_requests_total")}
    key = 'deepinfer_requests_total{route="other",status="401"}'
    assert after[key] == before[key] + 3


def test_a_client_that_leaves_a_non_streaming_request_is_counted_as_an_abort(server, caplog):
    before = server.metrics()
    port = int(server.url.rsplit(":", 1)[1])
    with caplog.at_level(logging.WARNING):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            long = _completion_body(max_tokens=1500, temperature=0)  # greedy: no early EOS on this model
            sock.sendall(_raw_request("/v1/completions", json.dumps(long).encode()))
            end = time.monotonic() + 30
            while server.metrics()["deepinfer_requests_running"] < 1:
                assert time.monotonic() < end, "the request never ran"
                time.sleep(0.05)
        after = _idle(server)
    gone = 'deepinfer_requests_total{route="/v1/completions",status="499"}'
    failed = 'deepinfer_requests_total{route="/v1/completions",status="500"}'
    assert after.get(gone, 0) == before.get(gone, 0) + 1 and after.get(failed, 0) == before.get(failed, 0)
    abort = 'deepinfer_request_finish_total{reason="abort"}'
    assert after[abort] == before.get(abort, 0) + 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


# -- the async front end ------------------------------------------------------------------------------

def test_disconnect_mid_stream_aborts_and_frees_the_request(server):
    before = server.metrics().get('deepinfer_request_finish_total{reason="abort"}', 0)
    stream = server.client().chat.completions.create(model=server.model, messages=_user("Talk"), max_tokens=1500,
                                                     temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert server.metrics()["deepinfer_requests_running"] == 1
    stream.close()
    m = _idle(server, timeout=5)
    assert m['deepinfer_request_finish_total{reason="abort"}'] == before + 1


def test_50_concurrent_clients_match_the_offline_engine(server):
    from deepinfer import LLM, SamplingParams

    prompts = [f"Request number {i}: " + "abc " * (i % 7) for i in range(50)]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)

    async def one(p: str, i: int) -> tuple[str, int]:
        if i % 2:
            chunks = [c async for c in await client.completions.create(
                model=server.model, prompt=p, max_tokens=5, temperature=0, stream=True,
                stream_options={"include_usage": True})]
            assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])  # OpenAI's usage chunk
            return "".join(c.choices[0].text for c in chunks[:-1]), chunks[-1].usage.completion_tokens
        out = await client.completions.create(model=server.model, prompt=p, max_tokens=5, temperature=0)
        return out.choices[0].text, out.usage.completion_tokens

    async def all_of_them() -> list[tuple[str, int]]:
        try:
            return await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts)))
        finally:
            await client.close()

    served = asyncio.run(all_of_them())
    llm = LLM(model=server.path, **ENGINE)
    offline = [(o.outputs[0].text, len(o.outputs[0].token_ids))
               for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)]
    llm.shutdown()
    assert served == offline
    _idle(server)


def test_queue_full_gets_429_with_retry_after(server, monkeypatch):
    monkeypatch.setattr(server.front, "max_pending", 1)
    client = server.client()
    stream = client.chat.completions.create(model=server.model, messages=_user("Talk"), max_tokens=1500,
                                            temperature=0, stream=True)
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=server.model, prompt="hi", max_tokens=2)
    assert int(info.value.response.headers["Retry-After"]) >= 1
    stream.close()
    _idle(server)
    assert client.completions.create(model=server.model, prompt="hi", max_tokens=2).choices[0].text is not None


def test_request_timeout_aborts_with_504(server, monkeypatch):
    monkeypatch.setattr(server.settings, "request_timeout_s", 0.5)
    with pytest.raises(openai.APIStatusError) as info:
        server.client().completions.create(model=server.model, prompt="hi", max_tokens=1500, temperature=0)
    assert info.value.status_code == 504 and "did not finish" in info.value.message
    _idle(server)


# -- the chat-format adapter -------------------------------------------------------------------------

def test_v41_encoding_over_a_tokenizer_without_its_tokens_is_reported(server):
    from deepinfer.server.chat_format import ChatFormat, RequestError

    chat = ChatFormat(model_type="deepseek_v41", tokenizer_file=server.path + "/tokenizer.json",
                      served_model_name="m", max_model_len=512)
    assert chat.unavailable is not None and "<｜System｜>" in chat.unavailable
    with pytest.raises(RequestError) as info:
        chat.prepare({"model": "m", "messages": _user("hi")})
    assert info.value.status == 503
    other = ChatFormat(model_type="toy", tokenizer_file=None, served_model_name="m", max_model_len=512)
    assert "DeepSeek-V4 or V4.1" in other.unavailable


@pytest.fixture(scope="module")
def v41_with_system_token(tmp_path_factory):
    """A tiny DeepSeek-V4.1; make-model gives its cut-down tokenizer `<｜System｜>`, as the V4.1
    release's tokenizer has (the V4 tokenizer it starts from lacks it)."""
    from deepinfer.models.deepseek_v41.make_model import make_model

    path = make_model(tmp_path_factory.mktemp("v41chat") / "tiny", "tiny", seed=0, max_position_embeddings=2048)
    data = json.loads((path / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8"))
    assert "<｜System｜>" in {t["content"] for t in data["added_tokens"]}
    return str(path)


@pytest.mark.slow
def test_v41_chat_renders_constrains_and_parses_a_tool_call(v41_with_system_token):
    """V4.1's encoding and xgrammar's deepseek_v4_1 tag through the offline engine, no server."""
    from deepinfer import LLM
    from deepinfer.server.chat_format import ChatFormat

    llm = LLM(model=v41_with_system_token, **{**ENGINE, "max_model_len": 2048})
    chat = ChatFormat(model_type=llm.build_info.model_type, tokenizer_file=llm.tokenizer.source,
                      served_model_name="v41", max_model_len=2048, default_thinking=False)
    assert chat.unavailable is None
    body = {"model": "v41", "messages": _user("Weather in Rome?"), "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 400, "temperature": 1, "seed": 4}
    prepared = chat.prepare(body)
    assert prepared.params.so_args["schema_type"] == "ebnf"
    (result,) = llm.generate({"prompt_token_ids": prepared.prompt_token_ids}, prepared.params, use_tqdm=False)
    llm.shutdown()
    # the prompt opened the calls block; the constrained output goes on with the first invoke
    text = llm.tokenizer.decode(result.outputs[0].token_ids)
    assert text.startswith('<｜DSML｜ invoke name="get_weather">'), text
    out = chat.output(prepared, "chatcmpl-v41", llm.tokenizer)
    out.push(result.outputs[0].token_ids)
    out.finish(result.outputs[0].finish_reason)
    message = out.response_dict()["choices"][0]
    assert message["finish_reason"] == "tool_calls", message
    (call,) = message["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7


def test_thinking_mode_constrains_the_answer_after_the_reasoning(server):
    """With thinking on, a JSON schema applies after `</think>`: reasoning text is free."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    chat = server.app.state.chat
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    prepared = chat.prepare({"model": server.model, "messages": _user("a number, as JSON"),
                             "thinking": {"type": "enabled"},
                             "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    grammar = Grammar.from_ebnf(prepared.params.so_args["schema"])
    assert _is_grammar_accept_string(grammar, 'let me think, 3 is fine</think>{"n": 3}')
    assert not _is_grammar_accept_string(grammar, '{"n": 3}')  # the reasoning block comes first
    assert not _is_grammar_accept_string(grammar, 'hmm</think>{"n": "three"}')


# -- start-up and shutdown of `deepinfer serve` -------------------------------------------------------

@pytest.mark.parametrize("flag, env", [(["--api-key", ""], None), (["--api-key", "  "], None), ([], "")],
                         ids=["empty-flag", "blank-flag", "empty-variable"])
def test_an_empty_api_key_is_refused_at_start_up(flag, env, clean_env, capsys, tmp_path):
    from deepinfer.entrypoints.serve import main

    if env is not None:
        clean_env.setenv("DEEPINFER_API_KEY", env)
    # a model that does not exist: were the key accepted, start-up would fail later, with exit code 1
    assert main([*flag, "--model", str(tmp_path / "no-such-model")]) == 2
    err = capsys.readouterr().err
    assert "is empty" in err and ("--api-key" if flag else "DEEPINFER_API_KEY") in err


def test_the_model_may_be_given_positionally_as_vllm_takes_it(tmp_path, capsys, clean_env):
    from deepinfer.entrypoints.serve import build_parser, main

    args = build_parser().parse_args([str(tmp_path / "m"), "--data-parallel-size", "2", "--max-model-len", "64"])
    assert (args.model_tag, args.dp, args.max_model_len) == (str(tmp_path / "m"), 2, 64)
    with pytest.raises(SystemExit):
        main(["a", "--model", "b"])
    assert "the model is given twice" in capsys.readouterr().err
    # the positional model is the one loaded: a missing one is the start-up error, naming it
    assert main([str(tmp_path / "no-such-model"), "--accelerator", "cpu"]) == 1
    assert "no-such-model" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_sigterm_aborts_running_requests_after_the_shutdown_timeout_and_exits(server, tmp_path):
    """The real command in its own process: SIGTERM stops accepting, gives the running requests
    --shutdown-timeout seconds, then ends them (an error event on a stream, a 503 otherwise) and
    the process exits cleanly."""
    import os
    import signal
    import subprocess
    import sys

    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.cli", "serve", "--model", server.path,
                             "--port", str(port), "--accelerator", "cpu", "--dtype", "float32",
                             "--max-model-len", "2048", "--threads-per-rank", "1", "--no-thinking",
                             "--shutdown-timeout", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, "the server did not start"
            time.sleep(0.2)
        long = {"model": "tiny-v4", "prompt": "hi", "max_tokens": 1900, "temperature": 0}  # greedy: runs to length
        answers: dict[str, httpx.Response] = {}
        waiting = threading.Thread(target=lambda: answers.update(plain=httpx.post(url + "/v1/completions", json=long,
                                                                                  timeout=120)))
        waiting.start()
        events = []
        with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=120) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            while "deepinfer_requests_running 2" not in httpx.get(url + "/metrics").text:  # both run
                assert waiting.is_alive(), answers
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            events += [line[6:] for line in lines if line.startswith("data: ")]
        waiting.join(timeout=120)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] != "[DONE]"
    error = json.loads(events[-1])["error"]
    assert error["type"] == "unavailable" and "shut down before this request finished" in error["message"]
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-1])
    plain = answers["plain"]
    assert plain.status_code == 503 and "shut down before this request finished" in plain.json()["error"]["message"]
    assert "aborting 2 request(s) still running after 1 s" in proc.stdout.read()


def _png_data_url(width: int = 20, height: int = 10) -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("route,kind,url,words", [
    ("/v1/chat/completions", "image_url", "png", "does not take image input"),
    ("/v1/responses", "input_image", "png", "does not take image input"),
    ("/v1/chat/completions", "image_url", "data:image/png;base64,iVBORw0KGgo=", "messages[0].content[1]: the image cannot be read"),
    ("/v1/chat/completions", "image_url", "https://example.com/cat.png", "is not fetched"),
    ("/v1/responses", "input_image", "data:image/png;base64,@@@", "input[0].content[1]: the data: URL's data is not valid base64"),
], ids=["chat", "responses", "not-an-image", "http-url", "bad-base64"])
def test_image_parts_on_a_text_model_are_a_400_not_dropped(server, route, kind, url, words):
    """Before, the chat format rendered an image part as "[Unsupported Image]" and the server answered
    200 with the image silently ignored. Now the image reaches admission, which refuses it on a model
    without a vision tower; a bad image is a 400 naming its part."""
    pytest.importorskip("PIL")
    url = _png_data_url() if url == "png" else url
    part = {"type": kind, "image_url": {"url": url} if kind == "image_url" else url}
    text = {"type": "text" if kind == "image_url" else "input_text", "text": "what is this?"}
    turns = [{"role": "user", "content": [text, part]}]
    body = ({"model": "tiny-v4", "max_tokens": 2, "messages": turns} if route == "/v1/chat/completions"
            else {"model": "tiny-v4", "max_output_tokens": 2, "input": turns})
    r = _post(server, route, json.dumps(body))
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.json()
    _idle(server)
