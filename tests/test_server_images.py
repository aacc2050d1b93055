"""`deepinfer serve` with image content parts on a tiny DeepSeek-V4.1 with a vision tower: the
`openai` client sends a data: URL image (Chat Completions and Responses) and gets an answer whose
prompt counts the image's span; the answer is the offline engine's for the same prompt and image;
bad images are a 400 naming the part."""
from __future__ import annotations

import base64
import io
import threading

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
    from deepinfer.entrypoints.serve import build_server
    from deepinfer.models.deepseek_v41.make_model import make_model
    from deepinfer.server.protocol import ServerSettings
    from server_harness import running_server

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = str(make_model(tmp_path_factory.mktemp("serve-images") / "tiny", "tiny", seed=4, with_vision=True,
                          dtype="float32"))
    settings = ServerSettings(api_key=KEY, default_thinking=False, max_pending=16)
    with running_server(*build_server(settings, model=path, **ENGINE)) as url:
        yield url, path
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


def test_messages_with_an_image_part_answers_as_chat_completions(served):
    """Anthropic Messages' `image` part (a base64 source) renders and answers as the same image sent
    to Chat Completions as a data: URL; a source it cannot load is a 400 naming the part."""
    url, _ = served
    image, headers = picture(40, 28, seed=3), {"x-api-key": KEY}
    encoded = data_url(image).split(",", 1)[1]
    body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded}},
        {"type": "text", "text": "what is in this picture?"}]}]}
    r = httpx.post(url + "/v1/messages", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    chat = _client(url).chat.completions.create(model="tiny", max_tokens=5, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                     {"type": "text", "text": "what is in this picture?"}]}])
    assert r.json()["usage"]["input_tokens"] == chat.usage.prompt_tokens
    assert "".join(block["text"] for block in r.json()["content"] if block["type"] == "text") == \
        chat.choices[0].message.content
    body["messages"][0]["content"][0]["source"] = {"type": "url", "url": "http://example.com/a.png"}
    r = httpx.post(url + "/v1/messages", json=body, headers=headers, timeout=120)
    assert r.status_code == 400 and "messages[0].content[0]: image URL" in r.text and "is not fetched" in r.text


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


# --- image URLs: http(s) with an allow-list, local files under a folder, limits -------------------

LIMIT_BYTES, LIMIT_PIXELS = 60_000, 150 * 150


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def media_host(tmp_path_factory):
    """A local http.server on 127.0.0.1 (no network): /img.png, a 404, a redirect to a host not
    allowed, a redirect to an allowed URL, an image over the byte limit and one over the pixel limit."""
    import http.server

    from PIL import Image

    pages = {"/img.png": png_bytes(picture(40, 28, seed=1)),
             "/big.png": png_bytes(picture(160, 140, seed=5)),  # random noise: more bytes than the limit
             "/wide.png": png_bytes(Image.new("RGB", (400, 100), (200, 10, 10)))}  # few bytes, too many pixels
    assert len(pages["/big.png"]) > LIMIT_BYTES and len(pages["/wide.png"]) < LIMIT_BYTES
    redirects = {"/away": "http://images.example.invalid/x.png", "/again": "/img.png"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path in redirects:
                self.send_response(302)
                self.send_header("Location", redirects[self.path])
                self.end_headers()
                return
            data = pages.get(self.path)
            if data is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", pages
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def media_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "img.png").write_bytes(png_bytes(picture(40, 28, seed=1)))
    (outside / "secret.png").write_bytes(png_bytes(picture(40, 28, seed=2)))
    (allowed / "link.png").symlink_to(outside / "secret.png")
    return allowed, outside


@pytest.fixture(scope="module")
def served_media(tmp_path_factory, media_dirs):
    """The server with image URLs on: 127.0.0.1 and localhost allowed, local files under one
    folder, and small limits (2 images, LIMIT_BYTES, LIMIT_PIXELS)."""
    from deepinfer.entrypoints.serve import build_server
    from deepinfer.models.deepseek_v41.make_model import make_model
    from deepinfer.server.protocol import ServerSettings
    from server_harness import running_server

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = str(make_model(tmp_path_factory.mktemp("serve-media") / "tiny", "tiny", seed=4, with_vision=True,
                          dtype="float32"))
    settings = ServerSettings(api_key=KEY, default_thinking=False, max_pending=16,
                              allowed_media_domains=["127.0.0.1", "LocalHost"],
                              allowed_local_media_path=str(media_dirs[0]), max_images_per_prompt=2,
                              max_image_bytes=LIMIT_BYTES, max_image_pixels=LIMIT_PIXELS, media_fetch_timeout_s=20)
    with running_server(*build_server(settings, model=path, **ENGINE)) as url:
        yield url
    torch.set_num_threads(threads)


def _ask(url: str, *image_urls: str, max_tokens: int = 4):
    content = [{"type": "text", "text": "what is in this picture?"}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    return _client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                max_tokens=max_tokens, temperature=0)


def test_allowed_http_and_local_images_answer_as_the_same_data_url(served_media, media_host, media_dirs):
    host, pages = media_host
    want = _ask(served_media, "data:image/png;base64," + base64.b64encode(pages["/img.png"]).decode())
    port = host.rsplit(":", 1)[1]
    for image_url in (host + "/img.png", f"http://localhost:{port}/img.png", host + "/again",
                      (media_dirs[0] / "img.png").as_uri()):
        got = _ask(served_media, image_url)
        assert got.choices[0].message.content == want.choices[0].message.content, image_url
        assert got.usage.prompt_tokens == want.usage.prompt_tokens > 10, image_url


@pytest.mark.parametrize("which,words", [
    ("http://127.0.0.2:9/img.png", "image URL host '127.0.0.2' is not in the server's allowed media domains"),
    ("/missing.png", "failed: HTTP 404"),
    ("/away", "redirects to 'http://images.example.invalid/x.png', which is not allowed"),
    ("/big.png", f"more than the limit of {LIMIT_BYTES}"),
    ("/wide.png", f"the image is 400x100 pixels, more than the limit of {LIMIT_PIXELS} pixels"),
    ("ftp://127.0.0.1/img.png", "is not a data:, http(s) or file: URL"),
])
def test_image_url_refusals_are_a_400_naming_the_part(served_media, media_host, which, words):
    host, _ = media_host
    image_url = host + which if which.startswith("/") else which
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(served_media, image_url)
    message = caught.value.body["message"] if isinstance(caught.value.body, dict) else str(caught.value)
    assert message.startswith("messages[0].content[1]: ") and words in message, message


def test_local_files_outside_the_allowed_folder_are_refused(served_media, media_dirs):
    allowed, outside = media_dirs
    for path in (outside / "secret.png", allowed / "link.png", allowed / ".." / "outside" / "secret.png"):
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\]: .* is not under the server's "
                                                         r"allowed local media path"):
            _ask(served_media, "file://" + str(path))
    with pytest.raises(openai.BadRequestError, match="is not a file"):
        _ask(served_media, (allowed / "nothing.png").as_uri())


def test_the_images_per_prompt_limit_is_a_flag(served_media, media_dirs):
    uri = (media_dirs[0] / "img.png").as_uri()
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[3\]: a request may hold at most 2 images"):
        _ask(served_media, uri, uri, uri)
    assert _ask(served_media, uri, uri).usage.prompt_tokens > 20


def test_url_and_local_images_are_off_by_default(served, media_host, media_dirs):
    url, _ = served
    host, _ = media_host
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\]: image URL .* is not fetched "
                                                     r"\(fetching http\(s\) image URLs is off"):
        _ask(url, host + "/img.png")
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\]: local image files .* are off"):
        _ask(url, (media_dirs[0] / "img.png").as_uri())


def test_media_settings_are_checked(tmp_path):
    from deepinfer.server.protocol import ServerSettings

    assert ServerSettings(allowed_media_domains=[" Images.Example.com. ", "[::1]"]).allowed_media_domains == [
        "images.example.com", "::1"]
    for bad in ("http://images.example.com", "example.com/path", "example.com:8080", ""):
        with pytest.raises(ValueError, match="is not a host name"):
            ServerSettings(allowed_media_domains=[bad])
    with pytest.raises(ValueError, match="is not a folder"):
        ServerSettings(allowed_local_media_path=str(tmp_path / "nope"))


def test_serve_flags_reach_the_settings(tmp_path):
    from deepinfer.entrypoints import serve
    from deepinfer.server.images import MediaPolicy

    args = serve.build_parser().parse_args(["--allowed-media-domains", "A.example", "127.0.0.1",
                                            "--allowed-local-media-path", str(tmp_path), "--max-images-per-prompt", "3",
                                            "--max-image-bytes", "1000", "--max-image-pixels", "500",
                                            "--media-fetch-timeout", "2.5"])
    policy = MediaPolicy.from_settings(serve.server_settings(args))
    assert policy == MediaPolicy(allowed_domains=("a.example", "127.0.0.1"), allowed_local_path=str(tmp_path.resolve()),
                                 max_images=3, max_image_bytes=1000, max_image_pixels=500, fetch_timeout_s=2.5)
    default = MediaPolicy.from_settings(serve.server_settings(serve.build_parser().parse_args([])))
    assert default == MediaPolicy() and default.allowed_domains == () and default.allowed_local_path is None


def test_responses_input_image_by_http_url(served_media, media_host):
    host, pages = media_host

    def ask(image_url):
        body = {"model": "tiny", "max_output_tokens": 3, "temperature": 0, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "describe"}, {"type": "input_image", "image_url": image_url}]}]}
        return httpx.post(served_media + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=120)

    got, want = ask(host + "/img.png"), ask("data:image/png;base64," + base64.b64encode(pages["/img.png"]).decode())
    assert got.status_code == want.status_code == 200, got.text
    assert got.json()["usage"] == want.json()["usage"] and got.json()["output"][-1]["content"] == \
        want.json()["output"][-1]["content"]
    refused = ask(host + "/missing.png")
    assert refused.status_code == 400 and "input[0].content[1]: fetching the image URL" in refused.text, refused.text
