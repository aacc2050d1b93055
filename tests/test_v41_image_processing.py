"""DeepSeek-V4.1 image preprocessing: the resize plan's token counts (the reference's worked sizes)
and pixel values equal to NeMo AutoModel 0.7.0's processor."""
from __future__ import annotations

import pytest
import torch

from deepinfer.models.deepseek_v41.image_processing import (
    END, IMAGE, NEWLINE, START, plan_image, preprocess_image, span_roles,
)
from deepinfer.models.deepseek_v41.vision_config import VisionConfig, parse_vision_config, vision_config_problems

RELEASE = VisionConfig()

# (input w, h) -> (resized w, h, patch grid w, h, token grid w, h, positions): the reference notes' table
WORKED = {
    (224, 224): (546, 546, 39, 39, 13, 13, 184),
    (544, 544): (546, 546, 39, 39, 13, 13, 184),
    (800, 600): (812, 602, 58, 43, 20, 15, 317),
    (1920, 1080): (1708, 966, 122, 69, 41, 23, 968),
    (1344, 1344): (1302, 1302, 93, 93, 31, 31, 994),
}


@pytest.mark.parametrize("size", list(WORKED), ids=[f"{w}x{h}" for w, h in WORKED])
def test_worked_sizes(size):
    g = plan_image(*size, RELEASE)
    assert (g.width, g.height, g.patch_w, g.patch_h, g.n_w, g.n_h, g.num_tokens) == WORKED[size]


def _nemo_processing():
    pytest.importorskip("PIL")
    pytest.importorskip("nemo_automodel", reason="NeMo AutoModel 0.7.0 is the preprocessing oracle")
    from nemo_automodel.components.models.deepseek_v41 import processing
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41VisionConfig

    return processing, DeepseekV41VisionConfig


# very wide and very tall images take the closed form's degenerate branches; the rest its main one
PLANNED = [(1, 1), (13, 7), (224, 224), (800, 600), (600, 800), (1920, 1080), (1080, 1920), (4000, 3000),
           (1344, 1344), (5000, 40), (40, 5000), (100000, 50), (50, 100000), (3000, 1), (1, 3000), (8192, 8192)]


@pytest.mark.parametrize("size", PLANNED, ids=[f"{w}x{h}" for w, h in PLANNED])
def test_plan_matches_nemo(size):
    processing, NemoVision = _nemo_processing()
    ours = plan_image(*size, RELEASE)
    theirs = processing._plan_image_grid(*size, NemoVision())
    assert (ours.width, ours.height, ours.patch_w, ours.patch_h, ours.n_w, ours.n_h) == (
        theirs.width, theirs.height, theirs.vit_width, theirs.vit_height, theirs.llm_width, theirs.llm_height)
    assert ours.num_tokens <= RELEASE.max_image_tokens


def test_very_wide_and_very_tall_fit_the_budget():
    wide, tall = plan_image(100000, 50, RELEASE), plan_image(50, 100000, RELEASE)
    assert (wide.n_h, wide.num_tokens) == (1, 1024)
    assert (tall.n_w, tall.num_tokens) == (1, 1024)


def test_plan_with_max_wh_ratio_and_a_small_budget_matches_nemo():
    processing, NemoVision = _nemo_processing()
    settings = dict(max_wh_ratio=2.0, max_image_tokens=64, min_pixels=1000, patch_size=8, downsample_ratio=2)
    for size in [(900, 100), (100, 900), (300, 200), (37, 5)]:
        ours = plan_image(*size, VisionConfig(**settings))
        theirs = processing._plan_image_grid(*size, NemoVision(**settings))
        assert (ours.width, ours.height, ours.n_w, ours.n_h) == (theirs.width, theirs.height, theirs.llm_width,
                                                               theirs.llm_height)


def test_plan_refuses_an_empty_image():
    with pytest.raises(ValueError, match="positive size"):
        plan_image(0, 10, RELEASE)


def test_span_roles_layout():
    g = plan_image(800, 600, RELEASE)
    roles = span_roles(g).tolist()
    assert len(roles) == g.num_tokens == 317
    assert roles[0] == START and roles[-1] == END
    rows = roles[1:-1]
    assert rows == ([IMAGE] * 20 + [NEWLINE]) * 15


def _photo(width: int, height: int, seed: int = 0):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(data.numpy(), "RGB")


@pytest.mark.parametrize("size", [(300, 200), (800, 600), (90, 700)], ids=["small-wide", "800x600", "tall"])
def test_pixels_equal_nemo(size):
    processing, NemoVision = _nemo_processing()
    image = _photo(*size)
    ours = preprocess_image(image, RELEASE)
    theirs, grid = processing._preprocess_image(image, NemoVision())
    assert ours.patches.dtype == torch.bfloat16
    assert (ours.grid.patch_h, ours.grid.patch_w) == (grid.vit_height, grid.vit_width)
    assert torch.equal(ours.patches, theirs.flatten(1))


def test_pixels_with_squeeze_equal_nemo():
    processing, NemoVision = _nemo_processing()
    settings = dict(max_wh_ratio=2.0, max_image_tokens=64, min_pixels=1000, patch_size=8, downsample_ratio=2)
    image = _photo(400, 50, seed=3)
    ours = preprocess_image(image, VisionConfig(**settings))
    theirs, _ = processing._preprocess_image(image, NemoVision(**settings))
    assert torch.equal(ours.patches, theirs.flatten(1))


def test_digest_keys_on_pixels():
    pytest.importorskip("PIL")
    a, same, other = _photo(64, 48, 1), _photo(64, 48, 1), _photo(64, 48, 2)
    assert preprocess_image(a, RELEASE).digest == preprocess_image(same, RELEASE).digest
    assert preprocess_image(a, RELEASE).digest != preprocess_image(other, RELEASE).digest


def test_vision_config_block():
    assert parse_vision_config(None) is None
    assert parse_vision_config({"model_type": "deepseek_v41_vision", "num_hidden_layers": 0}) is None
    assert parse_vision_config({"model_type": "deepseek_v41_vision"}) == RELEASE
    assert vision_config_problems({"max_wh_ratio": None}) == []
    problems = vision_config_problems({"patch_size": 0, "hidden_size": 30, "num_attention_heads": 4})
    assert any("vision_config.patch_size = 0" in p for p in problems)
    assert any("num_attention_heads = 16" in p for p in vision_config_problems({"hidden_size": 30}))
    assert any("num_attention_heads" in p for p in vision_config_problems({"hidden_size": 40,
                                                                             "num_attention_heads": 4}))
