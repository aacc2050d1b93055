"""`deepinfer serve` with the clients people use, on 127.0.0.1: the `openai` SDK (every sampling
field against the offline engine, `n`, `best_of`, logprobs, echo, batched prompts, `models.retrieve`,
`beta.chat.completions.parse` with a strict schema, the Responses API), the `anthropic` SDK against
/v1/messages (streaming, a tool call), lm-evaluation-harness's own `local-completions` client
(a loglikelihood task and a generate_until task from local files), and `langchain-openai`. The
server is test_server.py's (a tiny random DeepSeek-V4, fp32, thinking off by default)."""
from __future__ import annotations

import json
import math

import pytest

from test_server import ENGINE, KEY, _idle, _user, httpx, openai, server  # noqa: F401  (server: the fixture)

from deepinfer.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def offline(server):  # noqa: F811
    from deepinfer import LLM

    llm = LLM(model=server.path, **ENGINE)
    yield llm
    llm.shutdown()


def _offline(llm, prompt, **kw):
    ids = llm.tokenizer.encode(prompt, add_bos=True) if isinstance(prompt, str) else prompt
    (out,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(**kw), use_tqdm=False)
    return out


# -- every sampling field: the offline engine's output, or a 400 naming it -----------------------------------

FIELDS = [
    # negative penalties (a repetition penalty below 1) favour repeats: the random model's near-flat
    # logits then change at once
    ({"presence_penalty": -2.0}, {"presence_penalty": -2.0}),
    ({"frequency_penalty": -1.5}, {"frequency_penalty": -1.5}),
    ({"repetition_penalty": 0.3}, {"repetition_penalty": 0.3}),
    ({"logit_bias": {"77": 100}}, {"logit_bias": {77: 100.0}}),
    ({"top_k": 3, "temperature": 1.0, "seed": 5}, {"top_k": 3, "temperature": 1.0, "seq_seed": 5}),
    ({"min_p": 0.2, "temperature": 1.0, "seed": 6}, {"min_p": 0.2, "temperature": 1.0, "seq_seed": 6}),
    ({"min_tokens": 6, "stop_token_ids": [77], "logit_bias": {"77": 100}},
     {"min_tokens": 6, "stop_token_ids": [77], "logit_bias": {77: 100.0}}),
    ({"ignore_eos": True}, {"ignore_eos": True}),
]


@pytest.mark.parametrize("fields, offline_kw", FIELDS, ids=[next(iter(f)) for f, _ in FIELDS[:6]] +
                         ["min_tokens-stop_token_ids", "ignore_eos"])
def test_each_sampling_field_gives_the_offline_engines_output(server, offline, fields, offline_kw):  # noqa: F811
    base = {"temperature": 0.0, "max_tokens": 8}
    client = server.client()
    got = client.completions.create(model=server.model, prompt="The fields", **{**base, **{
        k: v for k, v in fields.items() if k in ("temperature", "seed", "presence_penalty", "frequency_penalty",
                                                   "logit_bias")}},
        extra_body={k: v for k, v in fields.items() if k not in ("temperature", "seed", "presence_penalty",
                                                                  "frequency_penalty", "logit_bias")})
    want = _offline(offline, "The fields", **{**base, **offline_kw})
    plain = _offline(offline, "The fields", **base)
    assert got.choices[0].text == want.outputs[0].text
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    if "ignore_eos" not in fields:
        assert want.outputs[0].token_ids != plain.outputs[0].token_ids  # the field changed something
    chat = client.chat.completions.create(model=server.model, messages=_user("The fields"), max_tokens=8,
                                          temperature=fields.get("temperature", 0.0),
                                          extra_body={k: v for k, v in fields.items() if k != "temperature"})
    prompt = server.app.state.chat.prepare({"model": server.model, "messages": _user("The fields")}).prompt_token_ids
    want_chat = _offline(offline, prompt, **{**base, **offline_kw})
    assert chat.usage.completion_tokens == len(want_chat.outputs[0].token_ids)


@pytest.mark.parametrize("route, field", [("/v1/completions", "functions"), ("/v1/chat/completions", "functions"),
                                          ("/v1/chat/completions", "store"), ("/v1/completions", "suffix"),
                                          ("/v1/chat/completions", "chat_template_kwargs.enable_thinking"),
                                          ("/v1/chat/completions", "best_of")])
def test_fields_not_honoured_are_refused_by_name(server, route, field):  # noqa: F811
    body = {"model": server.model, "max_tokens": 2}
    body.update({"prompt": "hi"} if route == "/v1/completions" else {"messages": _user("hi")})
    if "." in field:
        outer, inner = field.split(".")
        body[outer] = {inner: False}
    else:
        body[field] = "x" if field in ("suffix",) else 2 if field == "best_of" else True
    r = httpx.post(server.url + route, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and field.split(".")[-1] in r.json()["error"]["message"]


def test_max_completion_tokens_is_honoured(server):  # noqa: F811
    out = server.client().chat.completions.create(model=server.model, messages=_user("Count"), temperature=0,
                                                  max_completion_tokens=5)
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_thinking_through_chat_template_kwargs_or_deepseeks_field(server):  # noqa: F811
    client = server.client()
    on = client.chat.completions.create(model=server.model, messages=_user("Think"), temperature=0, max_tokens=6,
                                        extra_body={"chat_template_kwargs": {"thinking": True}})
    on_ds = client.chat.completions.create(model=server.model, messages=_user("Think"), temperature=0, max_tokens=6,
                                           extra_body={"thinking": {"type": "enabled"}})
    assert on.choices[0].message.model_extra.get("reasoning_content") is not None
    assert on.model_dump()["choices"] == on_ds.model_dump()["choices"]
    with pytest.raises(openai.BadRequestError, match="contradicts"):
        client.chat.completions.create(model=server.model, messages=_user("x"), max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"thinking": True},
                                                   "thinking": {"type": "disabled"}})


# -- n, best_of, logprobs, echo, batches ----------------------------------------------------------------

def test_n_samples_equal_seeded_offline_requests_streamed_or_not(server, offline):  # noqa: F811
    client = server.client()
    got = client.completions.create(model=server.model, prompt="Three ways", n=3, seed=21, temperature=1.0,
                                    max_tokens=6)
    want = [_offline(offline, "Three ways", temperature=1.0, max_tokens=6, seq_seed=21 + i).outputs[0].text
            for i in range(3)]
    assert [c.index for c in got.choices] == [0, 1, 2] and [c.text for c in got.choices] == want
    chunks = list(client.completions.create(model=server.model, prompt="Three ways", n=3, seed=21, temperature=1.0,
                                            max_tokens=6, stream=True))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == want
    chat = client.chat.completions.create(model=server.model, messages=_user("Three"), n=3, seed=4, temperature=1.0,
                                          max_tokens=6)
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 18
    _idle(server)


def test_best_of_and_batched_prompts(server, offline):  # noqa: F811
    client = server.client()
    best = client.completions.create(model=server.model, prompt="Best", n=1, best_of=4, seed=8, temperature=1.0,
                                     max_tokens=5, logprobs=0)
    every = [_offline(offline, "Best", temperature=1.0, max_tokens=5, seq_seed=8 + i).outputs[0] for i in range(4)]
    top = max(every, key=lambda o: o.cumulative_logprob / len(o.token_ids))
    assert best.choices[0].text == top.text and best.usage.completion_tokens == 20
    batch = client.completions.create(model=server.model, prompt=["one", "two", "three"], n=2, temperature=0,
                                      max_tokens=4)
    assert [c.index for c in batch.choices] == list(range(6))
    assert batch.choices[4].text == _offline(offline, "three", temperature=0, max_tokens=4).outputs[0].text
    ids = client.completions.create(model=server.model, prompt=[[5, 6, 7], [8, 9]], temperature=0, max_tokens=4)
    assert ids.choices[1].text == _offline(offline, [8, 9], temperature=0, max_tokens=4).outputs[0].text
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=server.model, prompt="x", n=1, best_of=2, stream=True, max_tokens=2)


def test_echo_with_logprobs_scores_the_prompt_as_the_offline_engine(server, offline):  # noqa: F811
    ids = offline.tokenizer.encode("Score this sentence", add_bos=True)
    out = server.client().completions.create(model=server.model, prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                             temperature=0)
    lp = out.choices[0].logprobs
    want = _offline(offline, ids, max_tokens=0, prompt_logprobs=1).prompt_logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[1:] == pytest.approx([e[t].logprob for e, t in zip(want[1:], ids[1:])], abs=1e-5)
    assert out.choices[0].text == offline.tokenizer.decode(ids) and out.usage.completion_tokens == 0
    gen = server.client().completions.create(model=server.model, prompt="Hi", max_tokens=3, logprobs=2, temperature=0)
    # the token and its 2 most likely alternatives (two byte tokens may share a key such as '\ufffd')
    logprobs = gen.choices[0].logprobs
    assert len(logprobs.tokens) == 3 and all(1 <= len(t) <= 3 for t in logprobs.top_logprobs)


def test_chat_logprobs(server, offline):  # noqa: F811
    out = server.client().chat.completions.create(model=server.model, messages=_user("Hi"), max_tokens=4,
                                                  temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and math.isfinite(c.logprob) for c in content)
    prompt = server.app.state.chat.prepare({"model": server.model, "messages": _user("Hi")}).prompt_token_ids
    want = _offline(offline, prompt, max_tokens=4, temperature=0, logprobs=2).outputs[0]
    assert [c.logprob for c in content] == pytest.approx(
        [e[t].logprob for e, t in zip(want.logprobs, want.token_ids)], abs=1e-5)


# -- the rest of the API ------------------------------------------------------------------------------

def test_models_retrieve_tokenize_detokenize_version_and_request_ids(server):  # noqa: F811
    client = server.client()
    assert client.models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    auth = {"Authorization": f"Bearer {KEY}"}
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"}, headers=auth).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"][1:]}, headers=auth).json()
    assert text["prompt"] == "hello world"
    from deepinfer.version import __version__
    assert httpx.get(server.url + "/version", headers=auth).json() == {"version": __version__}
    r = httpx.post(server.url + "/v1/completions", headers={**auth, "X-Request-Id": "mine-42"},
                   json={"model": server.model, "prompt": "hi", "max_tokens": 1})
    assert r.headers["x-request-id"] == "mine-42"
    again = httpx.post(server.url + "/v1/completions", headers=auth,
                       json={"model": server.model, "prompt": "hi", "max_tokens": 1})
    assert len(again.headers["x-request-id"]) == 32 and again.json()["id"] != r.json()["id"]
    assert r.json()["id"].startswith("cmpl-") and len(r.json()["id"]) > 30


def test_latency_histograms_count_each_request(server):  # noqa: F811
    before = server.metrics()
    server.client().completions.create(model=server.model, prompt="time me", max_tokens=5, temperature=0)
    after = server.metrics()
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        key = f"deepinfer_{name}_seconds_count"
        assert after[key] == before.get(key, 0) + 1, name
    assert after["deepinfer_inter_token_latency_seconds_count"] == before.get(
        "deepinfer_inter_token_latency_seconds_count", 0) + 4
    assert after["deepinfer_generation_tokens_total"] == before["deepinfer_generation_tokens_total"] + 5


# -- structured outputs take the schema whole -------------------------------------------------------------

@pytest.mark.slow
def test_parse_with_a_strict_schema_enforces_max_length(server):  # noqa: F811
    pydantic = pytest.importorskip("pydantic")

    class Name(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=12)
        tags: list[str] = pydantic.Field(min_length=2, max_length=2)

    out = server.client().beta.chat.completions.parse(model=server.model, messages=_user("A name"), max_tokens=200,
                                                      temperature=1.0, seed=3, response_format=Name)
    parsed = out.choices[0].message.parsed
    assert parsed is not None and len(parsed.name) <= 12 and len(parsed.tags) == 2


def test_a_keyword_the_grammar_cannot_enforce_is_refused_by_name(server):  # noqa: F811
    schema = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        server.client().chat.completions.create(
            model=server.model, messages=_user("x"), max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


# -- Responses and Messages -----------------------------------------------------------------------------

def test_responses_api_streaming_and_not(server):  # noqa: F811
    client = server.client()
    out = client.responses.create(model=server.model, input="Say something", max_output_tokens=6, temperature=0)
    assert out.status == "incomplete" and out.output_text
    events = list(client.responses.create(model=server.model, input="Say something", max_output_tokens=6,
                                          temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == out.output_text


def test_anthropic_messages_streaming_and_a_tool_call(server):  # noqa: F811
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    msg = client.messages.create(model=server.model, max_tokens=6, extra_body={"temperature": 0},
                                 messages=[{"role": "user", "content": "Hello"}])
    assert msg.role == "assistant" and msg.stop_reason == "max_tokens" and msg.content[0].type == "text"
    with client.messages.stream(model=server.model, max_tokens=6, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Hello"}]) as stream:
        text = "".join(stream.text_stream)
    assert text == msg.content[0].text
    tool = {"name": "get_weather", "description": "Current weather of a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                             "required": ["city"]}}
    called = client.messages.create(model=server.model, max_tokens=200, tools=[tool],
                                    tool_choice={"type": "tool", "name": "get_weather"},
                                    messages=[{"role": "user", "content": "Weather?"}])
    uses = [b for b in called.content if b.type == "tool_use"]
    assert called.stop_reason == "tool_use" and uses and uses[0].input["city"] in ("Paris", "Rome")


# -- langchain and lm-evaluation-harness -----------------------------------------------------------------

def test_langchain_invoke_and_structured_output(server):  # noqa: F811
    lc = pytest.importorskip("langchain_openai")
    pydantic = pytest.importorskip("pydantic")
    llm = lc.ChatOpenAI(model=server.model, base_url=server.url + "/v1", api_key=KEY, max_tokens=6, temperature=0,
                        max_retries=0, timeout=120)
    reply = llm.invoke("Hello")
    assert reply.response_metadata["token_usage"]["completion_tokens"] == 6  # max_completion_tokens honoured

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)

    structured = lc.ChatOpenAI(model=server.model, base_url=server.url + "/v1", api_key=KEY, max_tokens=100,
                               temperature=1.0, seed=2, max_retries=0, timeout=120)
    city = structured.with_structured_output(City, method="json_schema", strict=True).invoke("A city")
    assert isinstance(city, City) and len(city.name) <= 8


@pytest.mark.slow
def test_lm_eval_local_completions_scores_as_the_offline_engine(server, offline, tmp_path, monkeypatch):  # noqa: F811
    """lm-eval's own evaluator and `local-completions` client, default settings (it finds
    /tokenizer_info and /tokenize and tokenises through the server), on two tasks built from local
    files: a multiple-choice (loglikelihood) task and a generate_until task."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    tasks = _local_tasks(tmp_path)
    out = lm_eval.simple_evaluate(
        model="local-completions", model_args={"base_url": server.url + "/v1/completions", "model": server.model,
                                               "auth_token": KEY, "max_retries": 1},
        tasks=["deepinfer_local_mc", "deepinfer_local_gen"], task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True, limit=None)
    tok = offline.tokenizer
    scored = 0
    for sample in out["samples"]["deepinfer_local_mc"]:
        for (context, continuation), ((ll, _),) in zip(sample["arguments"], sample["resps"]):
            ctx = tok.encode(context) if context else []
            whole = ctx + tok.encode(continuation)
            prompt = _offline(offline, whole, max_tokens=0, prompt_logprobs=0).prompt_logprobs
            assert ll == pytest.approx(sum(prompt[k][whole[k]].logprob for k in range(len(ctx), len(whole))), abs=1e-5)
            scored += 1
    assert scored == 5
    for sample in out["samples"]["deepinfer_local_gen"]:
        (context, _), ((text,),) = sample["arguments"][0], [sample["resps"][0]]
        want = _offline(offline, tok.encode(context), temperature=0, max_tokens=6, stop=["\n\n"]).outputs[0].text
        assert text == want
    assert len(out["samples"]["deepinfer_local_gen"]) == 2


def _local_tasks(tmp_path):
    """Two lm-eval tasks over a local JSON-lines file (no dataset download)."""
    rows = [{"context": "The capital of France is", "choices": [" Paris", " Rome"], "answer": 0},
            {"context": "Two plus two equals", "choices": [" four", " five", " six"], "answer": 0}]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    folder = tmp_path / "tasks"
    folder.mkdir()
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              f"doc_to_text: \"{{{{context}}}}\"\n")
    (folder / "mc.yaml").write_text("task: deepinfer_local_mc\n" + common + "output_type: multiple_choice\n"
                                    "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
                                    "target_delimiter: \"\"\nmetric_list:\n  - metric: acc\n")
    (folder / "gen.yaml").write_text("task: deepinfer_local_gen\n" + common + "output_type: generate_until\n"
                                     "doc_to_target: \"{{choices[answer]}}\"\ngeneration_kwargs:\n"
                                     "  until: [\"\\n\\n\"]\n  max_gen_toks: 6\n  do_sample: false\n"
                                     "metric_list:\n  - metric: exact_match\n")
    return folder
