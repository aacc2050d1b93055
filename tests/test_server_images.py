"""`deepinfer serve` with image content parts on a tiny DeepSeek-V4.1 with a vision tower: the
`openai` client sends a data: URL image (Chat Completions and Responses) and gets an answer whose
prompt counts the image's span; the answer is the offline engine's for the same prompt and image;
bad images are a 400 naming the part."""
from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("deepseek_recipe")
pytest.importorskip("PIL")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

KEY = "test-key-images"
ENGINE = dict(accelerator="cpu", dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64)


def picture(width: int, height: int, seed: int):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import uvicorn

    from deepinfer.entrypoints.serve import build_server
    from deepinfer.models.deepseek_v41.make_model import make_model
    from deepinfer.server.protocol import ServerSettings

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = str(make_model(tmp_path_factory.mktemp("serve-images") / "tiny", "tiny", seed=4, with_vision=True,
                          dtype="float32"))
    settings = ServerSettings(api_key=KEY, default_thinking=False, max_pending=16)
    app, front = build_server(settings, model=path, **ENGINE)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", path
    srv.should_exit = True
    thread.join(timeout=30)
    front.shutdown()
    torch.set_num_threads(threads)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _tokenize(url: str, messages) -> int:
    r = httpx.post(url + "/tokenize", json={"messages": messages}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_chat_with_a_data_url_image_answers_with_the_offline_engines_tokens(served):
    from deepinfer import LLM, SamplingParams
    from deepinfer.models.deepseek_v41.image_processing import plan_image
    from deepinfer.models.deepseek_v41.make_model import VISION

    url, path = served
    image = picture(40, 28, seed=1)
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is in this picture?"},
                                             {"type": "image_url", "image_url": {"url": data_url(image)}}]}]
    out = _client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    rendered = _tokenize(url, messages)  # one placeholder per image
    span = plan_image(40, 28, VISION["tiny"]).num_tokens
    assert out.usage.prompt_tokens == len(rendered) - 1 + span
    with LLM(model=path, **ENGINE) as llm:
        offline = llm.generate({"prompt_token_ids": rendered, "multi_modal_data": {"image": image}},
                               SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert offline.error is None and len(offline.prompt_token_ids) == out.usage.prompt_tokens
    assert out.choices[0].message.content == offline.outputs[0].text


def test_responses_with_an_input_image(served):
    url, _ = served
    body = {"model": "tiny", "max_output_tokens": 3, "temperature": 0, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "describe"}, {"type": "input_image", "image_url": data_url(picture(24, 24, 2))}]}]}
    r = httpx.post(url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > 8  # the 24x24 image alone takes 8 positions


@pytest.mark.parametrize("image_url,words", [
    ("data:image/png;base64,AAAA", "messages[0].content[1]: the image cannot be read"),
    ("http://example.com/a.png", "is not fetched"),
])
def test_bad_images_are_a_400_naming_the_part(served, image_url, words):
    url, _ = served
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "image_url", "image_url": {"url": image_url}}]}]
    with pytest.raises(openai.BadRequestError, match=words.replace("[", r"\[").replace("]", r"\]")):
        _client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    ok = _client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_too_many_images_is_a_400(served):
    from deepinfer.server.images import MAX_IMAGES

    url, _ = served
    one = {"type": "image_url", "image_url": {"url": data_url(picture(8, 8, 0))}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}] + [one] * (MAX_IMAGES + 1)}]
    with pytest.raises(openai.BadRequestError, match=f"at most {MAX_IMAGES} images"):
        _client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=2)
