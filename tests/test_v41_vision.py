"""DeepSeek-V4.1's image tower: release-format loading of a tiny tower and its output against NeMo
AutoModel 0.7.0's vision transformer and aligner (float32, within 1e-5 of the output scale)."""
from __future__ import annotations

import json

import pytest
import torch

from deepinfer.models.deepseek_v41.checkpoint import load_checkpoint
from deepinfer.models.deepseek_v41.image_processing import END, IMAGE, NEWLINE, START, preprocess_image, span_roles
from deepinfer.models.deepseek_v41.make_model import VISION, make_model
from deepinfer.models.deepseek_v41.vision import VisionTower, vision_weight_shapes
from deepinfer.models.deepseek_v41.vision_config import VisionConfig
from model_harness import accelerator

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def tiny_vision(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("v41-vision") / "ckpt", size="tiny", with_vision=True)


def _image(width: int, height: int, seed: int = 0):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


def _tower(ckpt, accel):
    config, weights = load_checkpoint(ckpt, dtype=torch.float32)
    return config, VisionTower(config.vision, weights, accel, torch.float32, "cpu")


def test_release_layout_has_266_tensors_at_release_depth():
    assert len(vision_weight_shapes(VisionConfig(), 5120)) == 266
    shapes = vision_weight_shapes(VisionConfig(), 5120)
    assert shapes["aligner.w1.weight"] == (5120, 9216)
    assert shapes["vision.blocks.31.mlp.w1.weight"] == (5632, 1024)
    assert shapes["vision.patch_embed.proj.weight"] == (1024, 588)


def test_make_model_writes_and_loader_loads_the_tower(tiny_vision):
    data = json.loads((tiny_vision / "config.json").read_text())
    assert data["vision_config"]["num_hidden_layers"] == VISION["tiny"].num_hidden_layers
    config, weights = load_checkpoint(tiny_vision, dtype=torch.bfloat16)
    assert config.vision == VISION["tiny"]
    expected = vision_weight_shapes(config.vision, config.hidden_size)
    assert set(expected) <= set(weights)
    assert all(tuple(weights[k].shape) == v for k, v in expected.items())
    assert weights["vision.blocks.0.norm1.weight"].dtype == torch.float32  # norms stay fp32
    assert weights["vision.blocks.0.attn.wqkv.weight"].dtype == torch.bfloat16


def test_tower_without_vision_config_is_skipped(tiny_vision, tmp_path):
    import shutil

    copy = tmp_path / "text-only"
    shutil.copytree(tiny_vision, copy)
    data = json.loads((copy / "config.json").read_text())
    data["vision_config"] = {"model_type": "deepseek_v41_vision", "num_hidden_layers": 0}
    (copy / "config.json").write_text(json.dumps(data))
    config, weights = load_checkpoint(copy, dtype=torch.float32)
    assert config.vision is None and not any(k.startswith(("vision.", "aligner.", "image_")) for k in weights)


@pytest.mark.parametrize("size", [(24, 24), (50, 30), (13, 61)], ids=["square", "wide-padded", "tall"])
def test_tower_matches_nemo(tiny_vision, size):
    pytest.importorskip("nemo_automodel", reason="NeMo AutoModel 0.7.0 is the vision oracle")
    from v41_oracle import nemo_vision

    config, tower = _tower(tiny_vision, accelerator())
    image = preprocess_image(_image(*size), config.vision)
    grid = image.grid
    vit, aligner, delimiters = nemo_vision(tiny_vision)
    with torch.no_grad():
        nemo_states = vit(image.patches.float().view(grid.num_patches, 3, 4, 4), grid.patch_h, grid.patch_w)
        nemo_rows = aligner(nemo_states, grid.patch_h, grid.patch_w)
    states = tower.vit(image.patches, grid)
    rows = tower.align(states, grid)
    assert rows.shape == (grid.n_h * grid.n_w, config.hidden_size)
    scale = nemo_rows.abs().max()
    assert (states - nemo_states).abs().max() <= 1e-5 * nemo_states.abs().max()
    assert (rows - nemo_rows).abs().max() <= 1e-5 * scale
    span = tower.span_embeddings(image)
    roles = span_roles(grid)
    assert span.shape == (grid.num_tokens, config.hidden_size)
    assert torch.allclose(span[roles == IMAGE], nemo_rows, rtol=0, atol=1e-5 * float(scale))
    for role, name in ((START, "image_start"), (NEWLINE, "image_newline"), (END, "image_end")):
        assert torch.equal(span[roles == role], delimiters[name].expand(int((roles == role).sum()), -1))


def test_tower_attention_takes_the_fused_batched_kernel(tiny_vision, monkeypatch):
    """The tower calls SDPA with 4-D inputs: torch's fused CPU kernel takes only those, and 3-D ones
    fall back to a path that holds every [heads, n, n] score (10.6 GB for the release tower at a
    1344x1344 image); the rows equal a per-head reference computed by hand."""
    import torch.nn.functional as F

    from deepinfer.models.deepseek_v41 import vision

    config, tower = _tower(tiny_vision, accelerator())
    image = preprocess_image(_image(50, 30), config.vision)
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append(q.dim())
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(vision.F, "scaled_dot_product_attention", spy)
    states = tower.vit(image.patches, image.grid)
    assert seen and set(seen) == {4}

    def by_hand(q, k, v, *args, **kwargs):  # softmax(q k^T / sqrt(d)) v, whatever the input rank
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return weights @ v

    monkeypatch.setattr(vision.F, "scaled_dot_product_attention", by_hand)
    want = tower.vit(image.patches, image.grid)
    assert (states - want).abs().max() <= 1e-5 * want.abs().max()
