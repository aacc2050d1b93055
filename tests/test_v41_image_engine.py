"""DeepSeek-V4.1 image prompts through the engine (`LLM.generate` with `multi_modal_data`): greedy
tokens equal the model's own forward over the span; batched text + image requests with chunked
prefill splitting the spans equal batch-1; the prefix cache hits on the same image
and misses on a different one; image input is refused, alone, with its reason."""
from __future__ import annotations

import pytest
import torch

from deepinfer.sampling_params import SamplingParams

pytest.importorskip("PIL")

PLACEHOLDER = "<｜image｜>"  # token id 505 in tiny: make-model --vision spells it as deepseek-recipe does
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from deepinfer.models.deepseek_v4.make_model import make_model as make_v4
    from deepinfer.models.deepseek_v41.make_model import make_model

    root = tmp_path_factory.mktemp("v41-image-engine")
    return {"vision": str(make_model(root / "vision", "tiny", seed=2, with_vision=True)),
            "text": str(make_model(root / "text", "tiny", seed=2)),
            "v4": str(make_v4(root / "v4", "tiny", seed=2))}


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def picture(width: int, height: int, seed: int):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


def _llm(path, **kw):
    from deepinfer import LLM

    base = dict(model=path, accelerator="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
                max_num_batched_tokens=64)
    return LLM(**{**base, **kw})


def image_request(text_before: str, image, text_after: str = " what is it?"):
    return {"prompt": f"{text_before}{PLACEHOLDER}{text_after}", "multi_modal_data": {"image": image}}


REQUESTS = [
    image_request("look: ", picture(40, 28, 1)),
    "a plain text prompt about the weather today",
    {"prompt": f"two pictures {PLACEHOLDER} and {PLACEHOLDER}: compare",
     "multi_modal_data": {"image": [picture(24, 24, 2), picture(30, 45, 3)]}},
    {"prompt": f"{PLACEHOLDER} then text", "multi_modal_data": {"image": picture(50, 20, 4)}},
]


def _tokens(outs):
    for o in outs:
        assert o.error is None, o.error
    return [o.outputs[0].token_ids for o in outs]


def test_generate_equals_the_models_forward_over_the_span(ckpts, one_thread):
    from model_harness import Runner

    with _llm(ckpts["vision"]) as llm:
        out = llm.generate([REQUESTS[0]], GREEDY, use_tqdm=False)[0]
        model = llm.engine.model
        assert out.error is None, out.error
        prompt = out.prompt_token_ids
        generated = out.outputs[0].token_ids
        image_id = model.image_token_id
        start = prompt.index(image_id)
        span = model.preprocess_image(REQUESTS[0]["multi_modal_data"]["image"])
        assert prompt[start:start + span.num_tokens] == [image_id] * span.num_tokens == [
            t for t in prompt if t == image_id]
        from deepinfer.models.deepseek_v41.checkpoint import load_checkpoint
        from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
        from model_harness import accelerator

        config, weights = load_checkpoint(ckpts["vision"], torch.float32)
        reference = DeepseekV41ForCausalLM(config, accelerator(), dtype=torch.float32)
        reference.load_weights(weights)
    runner = Runner(reference)
    runner.add("s")
    tokens = prompt + generated[:-1]
    logits = runner.step({"s": tokens}, images={"s": [(start, span)]})["s"]
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == generated


def test_batched_and_chunked_equals_batch_one(ckpts, one_thread):
    requests = REQUESTS * 4
    params = [SamplingParams(temperature=0, max_tokens=6 + i % 5, ignore_eos=True) for i in range(len(requests))]
    single = _llm(ckpts["vision"], max_num_seqs=1, max_num_batched_tokens=128, async_pipeline=False,
                  max_model_len=80)  # the reference: one request at a time, one chunk
    reference = [_tokens(single.generate([r], p, use_tqdm=False))[0] for r, p in zip(requests, params)]
    per_request = single.build_info.pool.bytes_per_max_request
    single.shutdown()
    # 13-token steps split every span over chunks; a small pool keeps the batch changing
    with _llm(ckpts["vision"], max_num_batched_tokens=13, cache_memory_gb=2.5 * per_request / 2**30,
              async_pipeline=True, max_model_len=80) as llm:
        outs = llm.generate(requests, params, use_tqdm=False)
        assert _tokens(outs) == reference


def test_prefix_cache_keys_on_the_pixels(ckpts, one_thread):
    same, other = picture(40, 28, 1), picture(40, 28, 9)
    prompt = "describe this picture in detail please: "
    with _llm(ckpts["vision"]) as llm:
        want = {name: _tokens(llm.generate([image_request(prompt, im)], GREEDY, use_tqdm=False))[0]
                for name, im in (("same", same), ("other", other))}
    with _llm(ckpts["vision"], features={"prefix_cache": {"block_tokens": 8}}) as llm:
        first = _tokens(llm.generate([image_request(prompt, same)], GREEDY, use_tqdm=False))[0]
        stats = llm.stats()["prefix_cache"]
        assert stats["hits"] == 0
        again = _tokens(llm.generate([image_request(prompt, same)], GREEDY, use_tqdm=False))[0]
        stats = llm.stats()["prefix_cache"]
        assert stats["hits"] == 1 and stats["prefill_tokens_saved"] > 16  # past the text, into the span
        saved = stats["prefill_tokens_saved"]
        different = _tokens(llm.generate([image_request(prompt, other)], GREEDY, use_tqdm=False))[0]
        stats = llm.stats()["prefix_cache"]
    assert first == again == want["same"]
    assert different == want["other"]
    # the different image shares only the text before the span: at most those blocks are reused
    text_tokens = len(llm.get_tokenizer().encode(prompt, add_bos=True))
    assert stats["prefill_tokens_saved"] - saved <= text_tokens


@pytest.mark.parametrize("case,words", [
    ("v4", "does not take image input"),
    ("text", "text-only"),
    ("count", "has 1 image placeholders"),
    ("type", "not a PIL.Image.Image"),
    ("keys", 'the key "image" only'),
])
def test_image_input_is_refused_alone(ckpts, case, words, one_thread):
    image = picture(24, 24, 0)
    request = image_request("x ", image)
    path = ckpts["vision"]
    if case in ("v4", "text"):
        path = ckpts[case]
    elif case == "count":
        request = image_request("x ", [image, image])
    elif case == "type":
        request = image_request("x ", "photo.png")
    elif case == "keys":
        request = {"prompt": "x", "multi_modal_data": {"video": image}}
    with _llm(path) as llm:
        bad, good = llm.generate([request, "a text prompt"], GREEDY, use_tqdm=False)
    assert bad.error is not None and words in bad.error, bad.error
    assert good.error is None and len(good.outputs[0].token_ids) == 5


def test_preempted_inside_a_span_recomputes_the_image(ckpts, one_thread):
    """A request preempted after part of its image span is computed starts over from its prompt,
    images included: the tokens are those of an uninterrupted run."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with _llm(ckpts["vision"], async_pipeline=False) as llm:
        want = _tokens(llm.generate([REQUESTS[0]], params, use_tqdm=False))[0]
    with _llm(ckpts["vision"], async_pipeline=False, max_num_batched_tokens=8) as llm:
        engine = llm.engine
        req = engine.add_request(REQUESTS[0], params)
        (image,) = req.images
        while req.num_computed_tokens <= image.start:  # 8-token chunks: stop inside the span
            engine.step()
        assert image.start < req.num_computed_tokens < image.end
        engine.scheduler._preempt(req)  # what a full cache pool does to the newest request
        while engine.has_unfinished():
            engine.step()
        assert req.num_preemptions == 1
        assert req.to_output().outputs[0].token_ids == want


def test_chat_with_image_parts_is_the_rendered_prompt_with_its_images(ckpts, one_thread, tmp_path):
    """`LLM.chat`: an `image_pil` part, a data: URL and a file: URL under the allowed folder give the
    prompt the server's renderer makes for the same conversation, with the images in order."""
    pytest.importorskip("deepseek_recipe")
    import base64
    import io

    first, second = picture(40, 28, 5), picture(24, 30, 6)
    buf = io.BytesIO()
    second.save(buf, format="PNG")
    (tmp_path / "second.png").write_bytes(buf.getvalue())
    as_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    text = {"type": "text", "text": "compare these"}

    def conversation(second_part):
        return [{"role": "user", "content": [{"type": "image_pil", "image_pil": first}, text, second_part]}]

    with _llm(ckpts["vision"]) as llm:
        by_url = llm.chat(conversation({"type": "image_url", "image_url": {"url": as_url}}), GREEDY, use_tqdm=False)
        by_file = llm.chat(conversation({"type": "image_url", "image_url": {"url": f"file://{tmp_path}/second.png"}}),
                           GREEDY, allowed_local_media_path=str(tmp_path), use_tqdm=False)
        from deepinfer.offline_chat import OfflineChat
        rendered = OfflineChat(llm, thinking=False).prompt(conversation({"type": "image_pil", "image_pil": second}), 0)
        direct = llm.generate(rendered, GREEDY, use_tqdm=False)
        assert rendered["prompt_token_ids"].count(llm.engine.model.image_token_id) == 2
        assert _tokens(by_url) == _tokens(by_file) == _tokens(direct)
        with pytest.raises(ValueError, match=r"conversation 0: messages\[0\]\.content\[2\]: local image files"):
            llm.chat(conversation({"type": "image_url", "image_url": {"url": f"file://{tmp_path}/second.png"}}), GREEDY)
        with pytest.raises(TypeError, match="LLM.chat takes a conversation"):
            llm.chat("hello", GREEDY)
    with _llm(ckpts["text"]) as llm:  # a text-only model: text conversations, and images refused by name
        assert llm.chat([{"role": "user", "content": "hello"}], GREEDY, use_tqdm=False)[0].error is None
        with pytest.raises(ValueError, match=r"conversation 1: messages\[0\]\.content\[0\]: this DeepSeek-V4.1 "
                                             r"checkpoint is text-only"):
            llm.chat([[{"role": "user", "content": "hello"}],
                      conversation({"type": "image_url", "image_url": {"url": as_url}})], GREEDY, use_tqdm=False)


def test_bounded_replay_keeps_the_span_marks_of_its_kept_rows(ckpts, one_thread, monkeypatch):
    """SWA bounded replay (keep 24 rows) on a prompt ending inside an image's span: the decoder's kept
    rows reach the MoE with their span marks (bias_vl routing), the dropped ones never do."""
    from deepinfer.models.deepseek_v41.multimodal import VisionRoutedMoE

    seen = []
    run = VisionRoutedMoE.run
    monkeypatch.setattr(VisionRoutedMoE, "run", lambda self, x, step: (
        seen.append((x.shape[0], None if step.span_rows is None else int(step.span_rows.sum()))), run(self, x, step))[1])
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "24")
    request = {"prompt": f"a picture: {PLACEHOLDER} .", "multi_modal_data": {"image": picture(40, 40, 7)}}
    with _llm(ckpts["vision"], max_num_batched_tokens=128) as llm:
        out = llm.generate(request, GREEDY, use_tqdm=False)[0]
    assert out.error is None, out.error
    prompt_len = len(out.prompt_token_ids)
    kept = [(rows, marked) for rows, marked in seen if rows == 24]
    assert prompt_len > 24 and kept, seen
    assert all(0 < marked < 24 for _, marked in kept), kept  # the span's end and the text after it
