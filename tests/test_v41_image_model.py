"""DeepSeek-V4.1's text model with an image span: the span's embeddings from the tower, `bias_vl`
routing on span positions and Engram's dead tokens, against NeMo AutoModel 0.7.0's full model
(float32 logits); chunked prefill splitting a span and a ragged text + image batch against one
full forward."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer.models.batch import ImageSpan
from deepinfer.models.deepseek_v41.checkpoint import load_checkpoint
from deepinfer.models.deepseek_v41.image_processing import preprocess_image, span_roles
from deepinfer.models.deepseek_v41.make_model import make_model
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from model_harness import Runner, accelerator, max_rel_diff

pytest.importorskip("PIL")

BEFORE, AFTER = 13, 22  # text tokens around the image (the span crosses windows and compressed blocks)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("v41-image") / "tiny", "tiny", seed=5, with_vision=True)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_checkpoint(checkpoint, torch.float32)


def build(loaded) -> DeepseekV41ForCausalLM:
    config, weights = loaded
    model = DeepseekV41ForCausalLM(config, accelerator(), dtype=torch.float32)
    model.load_weights(weights)
    return model


def picture(width: int, height: int, seed: int):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


def image_prompt(config, image, seed: int = 0, before: int = BEFORE, after: int = AFTER):
    """(token ids with the span on image_token_id, the span's start)."""
    rng = random.Random(seed)
    text = [rng.randrange(3, 400) for _ in range(before + after)]
    return text[:before] + [config.image_token_id] * image.num_tokens + text[before:], before


def run(model, tokens, images=None, chunks=None):
    runner = Runner(model)
    runner.add("s")
    got, i = [], 0
    for n in chunks or [len(tokens)]:
        got.append(runner.step({"s": tokens[i:i + n]}, images={"s": images or []})["s"])
        i += n
    return torch.cat(got)


@pytest.fixture(scope="module")
def case(loaded):
    config = loaded[0]
    image = preprocess_image(picture(40, 28, seed=1), config.vision)
    tokens, start = image_prompt(config, image)
    return image, tokens, start


def test_span_layout_of_the_case(case, loaded):
    image, tokens, start = case
    assert image.num_tokens == 17 and (image.grid.n_h, image.grid.n_w) == (3, 4)
    assert tokens[start:start + 17] == [loaded[0].image_token_id] * 17


def test_image_prompt_matches_nemo(checkpoint, loaded, case):
    pytest.importorskip("nemo_automodel", reason="NeMo AutoModel 0.7.0 is the V4.1 oracle")
    from v41_oracle import build_nemo_model

    image, tokens, start = case
    types = torch.full((len(tokens),), -1, dtype=torch.long)
    types[start:start + image.num_tokens] = span_roles(image.grid).long()
    nemo = build_nemo_model(checkpoint, vision=True)
    p = loaded[0].vision.patch_size
    with torch.no_grad():
        ref = nemo(torch.tensor([tokens]), pixel_values=image.patches.float().view(-1, 3, p, p),
                   image_grid_hws=torch.tensor([[image.grid.patch_h, image.grid.patch_w]]),
                   vision_token_types=types[None]).logits[0].float()
    ours = run(build(loaded), tokens, [(start, image)])
    assert max_rel_diff(ours, ref) < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_image_changes_the_logits_after_it(loaded, case):
    image, tokens, start = case
    other = preprocess_image(picture(40, 28, seed=2), loaded[0].vision)
    a, b = run(build(loaded), tokens, [(start, image)]), run(build(loaded), tokens, [(start, other)])
    assert max_rel_diff(a[:start], b[:start]) < 1e-5  # causal: the text before the image does not see it
    assert not torch.allclose(a[start:], b[start:])


@pytest.mark.parametrize("chunks", [[5, 12, 4, 100], [BEFORE + 3, 1, 1, 100], [1] * 20 + [100]])
def test_chunked_prefill_splitting_the_span(loaded, case, chunks):
    image, tokens, start = case
    model = build(loaded)
    full = run(model, tokens, [(start, image)])
    assert max_rel_diff(run(model, tokens, [(start, image)], chunks), full) < 1e-5


def test_text_and_image_batch_equals_batch_one(loaded, case):
    image, tokens, start = case
    model = build(loaded)
    text = [random.Random(9).randrange(3, 400) for _ in range(29)]
    second = preprocess_image(picture(24, 24, seed=4), loaded[0].vision)
    tokens2, start2 = image_prompt(loaded[0], second, seed=7, before=4, after=9)
    refs = {"a": run(model, tokens, [(start, image)]), "t": run(model, text), "b": run(model, tokens2,
                                                                                       [(start2, second)])}
    runner = Runner(build(loaded))
    for k in refs:
        runner.add(k)
    images = {"a": [(start, image)], "b": [(start2, second)]}
    prompts = {"a": tokens, "t": text, "b": tokens2}
    got = {k: [] for k in refs}
    for lo, hi in ((0, 9), (9, 200)):  # the second image's span is split between the two steps
        out = runner.step({k: v[lo:hi] for k, v in prompts.items()}, images=images)
        for k in refs:
            got[k].append(out[k])
    for k, ref in refs.items():
        assert max_rel_diff(torch.cat(got[k]), ref) < 1e-5, k


def test_text_only_model_refuses_images(tmp_path, case):
    ckpt = make_model(tmp_path / "text", "tiny", seed=5)
    config, weights = load_checkpoint(ckpt, torch.float32)
    model = DeepseekV41ForCausalLM(config, accelerator(), dtype=torch.float32)
    model.load_weights(weights)
    image, tokens, start = case
    assert "text-only" in model.image_input_unsupported
    runner = Runner(model)
    runner.add("s")
    with pytest.raises(ValueError, match="text-only"):
        runner.step({"s": [5, 6, 7]}, images={"s": [(0, image)]})


def test_encoder_cache_runs_the_tower_once_per_image(loaded, case, monkeypatch):
    image, tokens, start = case
    model = build(loaded)
    calls = []
    original = model.images.tower.span_embeddings
    monkeypatch.setattr(model.images.tower, "span_embeddings", lambda im: calls.append(im.digest) or original(im))
    run(model, tokens, [(start, image)], chunks=[BEFORE + 2, 5, 100])
    run(model, tokens, [(start, image)])
    assert calls == [image.digest]
    assert isinstance(ImageSpan(0, start, image).image.digest, str)


def test_image_input_is_taken_under_bounded_replay(loaded):
    model = build(loaded)
    assert model.image_input_unsupported is None
    model.replay_keep_tokens = 64  # what set_bounded_replay(64) records: the kept rows keep their span marks
    assert model.image_input_unsupported is None
