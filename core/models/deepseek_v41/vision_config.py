"""DeepSeek-V4.1's `vision_config` block: the image tower's shape and the image sizing rules.

The release's values are the defaults (a 32-layer ViT of width 1024, 14-pixel patches, 3x3 cells
merged into one text position, at most 1,024 positions per image, images upscaled to at least
544x544 pixels). `parse_vision_config` reads the block of a composite config.json: a missing or
null block, or one with `num_hidden_layers: 0`, means a text-only model (None); every other value
is type- and range-checked, each problem a sentence naming the key (`vision_config.patch_size`).
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from deepinfer.models.common.config_values import (
    MAX_HEADS, MAX_LAYERS, MAX_WIDTH, Range, range_problems, show_value, type_name,
)

VISION_MODEL_TYPE = "deepseek_v41_vision"
MAX_IMAGE_PIXELS_SIDE = 1 << 15  # no setting may ask for an image side beyond this

FIELD_RANGES: dict[str, Range] = {
    "num_hidden_layers": Range(int, 0, MAX_LAYERS),
    "hidden_size": Range(int, 1, MAX_WIDTH),
    "num_attention_heads": Range(int, 1, MAX_HEADS),
    "intermediate_size": Range(int, 1, MAX_WIDTH),
    "patch_size": Range(int, 1, 256),
    "rope_theta": Range(float, 0, open_low=True),
    "downsample_ratio": Range(int, 1, 16),
    "max_image_tokens": Range(int, 4, 1 << 20),
    "min_pixels": Range(int, 1, MAX_IMAGE_PIXELS_SIDE ** 2),
    "max_wh_ratio": Range(float, 1, 1 << 15),
}


class VisionConfig(BaseModel):
    """The image tower and the image sizing (HF `vision_config` names; defaults: the release)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None
    rms_norm_eps: float = 1e-6  # not in the release's file: fixed by the reference tower

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """Inputs of the patch embedding: 3 colour planes of patch_size x patch_size pixels."""
        return 3 * self.patch_size ** 2

    @property
    def cell(self) -> int:
        """Pixels on a side of the square that becomes one text position."""
        return self.patch_size * self.downsample_ratio

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": VISION_MODEL_TYPE, **self.model_dump(exclude={"rms_norm_eps"})}


def vision_config_problems(block: Any) -> list[str]:
    """Sentences naming each invalid value of a `vision_config` block (empty: valid)."""
    if block is None:
        return []
    if not isinstance(block, dict):
        return [f"vision_config = {show_value(block)} has the wrong type ({type_name(block)}): must be an object "
                f"or null"]
    checked = {k: v for k, v in block.items() if not (k == "max_wh_ratio" and v is None)}  # null: no squeeze
    problems = [f"vision_config.{p}" for p in range_problems(checked, FIELD_RANGES)]
    if problems or not block.get("num_hidden_layers", 1):
        return problems
    merged = {**VisionConfig().model_dump(), **{k: v for k, v in block.items() if k in FIELD_RANGES}}
    heads, width = merged["num_attention_heads"], merged["hidden_size"]
    if width % heads or (width // heads) % 4:
        problems.append(f"vision_config.hidden_size = {width} must split into num_attention_heads = {heads} heads "
                        f"of a size divisible by 4 (the 2-D rotary embedding halves each head twice)")
    return problems


def parse_vision_config(block: Any) -> VisionConfig | None:
    """The `vision_config` block (already checked by `vision_config_problems`) as a VisionConfig,
    or None for a text-only model (no block, null, or `num_hidden_layers: 0`)."""
    if not block or not block.get("num_hidden_layers", VisionConfig().num_hidden_layers):
        return None
    return VisionConfig(**{k: v for k, v in block.items() if k in FIELD_RANGES})
