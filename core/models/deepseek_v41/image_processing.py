"""DeepSeek-V4.1 image preprocessing: the resize plan, the pixels, and the span an image takes.

An image becomes a patch grid of `patch_size` pixels (14 in the release); the tower's aligner merges
each `downsample_ratio` x `downsample_ratio` cell of patches (3x3) into one text position. In the
prompt an image is the span

    [START] + ([IMAGE] * n_w + [NEWLINE]) * n_h + [END]

on `image_token_id` at every position (the roles travel beside the ids), so an image costs
`n_h * (n_w + 1) + 2` positions. `plan_image(width, height, config)` gives that cost from the
image's size alone, before any pixel is touched (admission and `max_model_len` use it).

The resize plan (the reference's `image_processor.py`, as ported by vLLM, NeMo AutoModel and the
transformers draft, which agree):
  1. with `max_wh_ratio` set, an image wider than that ratio is planned as if squeezed to it;
  2. an image under `min_pixels` is scaled up by sqrt(min_pixels / (w*h)), each side truncated;
  3. both sides are rounded up to multiples of `patch_size`;
  4. if the cost is over `max_image_tokens`, the closed form picks the largest grid of the same
     aspect that fits: max_w = sqrt((max_image_tokens - 2) / r + 0.25) - 0.5 cells with r = h / w,
     a scale beta = min(floor(max_w) * cell / w, floor(max_w * r) * cell / h), sides floored to
     multiples of `patch_size` (an image less than one cell wide or tall gets one cell on that side
     and as many on the other as fit).

Pixels: the image is fitted into the planned size keeping its aspect (PIL bicubic), centred on
grey (127, 127, 127), scaled to [-1, 1] by (x / 255 - 0.5) / 0.5 and rounded to bfloat16 (as the
reference does), then cut into patches in row-major grid order, each channel-major (c, y, x).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.models.deepseek_v41.vision_config import VisionConfig

if TYPE_CHECKING:
    from PIL.Image import Image

# roles of the positions of an image span (the reference's vision token types)
START, IMAGE, NEWLINE, END = range(4)
GREY = (127, 127, 127)


@dataclass(frozen=True)
class ImageGrid:
    """Where an image of a given size lands: the resized size, its patch grid and its text grid."""

    width: int  # resized, pixels
    height: int
    patch_w: int  # patches per row / column: width // patch_size
    patch_h: int
    n_w: int  # text positions per row of the span (cells of downsample_ratio^2 patches)
    n_h: int

    @property
    def num_tokens(self) -> int:
        """Prompt positions the image's span takes: START, n_h rows of n_w images + NEWLINE, END."""
        return self.n_h * (self.n_w + 1) + 2

    @property
    def num_patches(self) -> int:
        return self.patch_h * self.patch_w


def _grid(width: int, height: int, config: VisionConfig) -> ImageGrid:
    p, r = config.patch_size, config.downsample_ratio
    return ImageGrid(width, height, width // p, height // p, math.ceil(width // p / r), math.ceil(height // p / r))


def _round_up(x: float, multiple: int) -> int:
    return math.ceil(x / multiple) * multiple


def plan_image(width: int, height: int, config: VisionConfig) -> ImageGrid:
    """The resized size and grids of a `width` x `height` image (module docstring: the plan).
    ValueError for a non-positive size or one the token budget cannot hold."""
    if width <= 0 or height <= 0:
        raise ValueError(f"an image must have a positive size; got {width}x{height} pixels")
    w: float = width
    h: float = height
    if config.max_wh_ratio is not None and w > h * config.max_wh_ratio:
        w = h * config.max_wh_ratio
    if w * h < config.min_pixels:
        scale = math.sqrt(config.min_pixels / (w * h))
        w, h = int(w * scale), int(h * scale)
    p = config.patch_size
    grid = _grid(_round_up(w, p), _round_up(h, p), config)
    budget = config.max_image_tokens
    if grid.num_tokens > budget:
        grid = _shrink(w, h, config)
    if grid.width <= 0 or grid.height <= 0 or grid.num_tokens > budget:
        raise ValueError(f"a {width}x{height} image cannot fit in {budget} image positions "
                         f"(vision_config.max_image_tokens)")
    return grid


def _shrink(w: float, h: float, config: VisionConfig) -> ImageGrid:
    """The largest grid of the image's aspect within `max_image_tokens` (the closed form)."""
    budget, cell, p = config.max_image_tokens, config.cell, config.patch_size
    aspect = h / w
    cells_w = math.sqrt((budget - 2) / aspect + 0.25) - 0.5  # n_h (n_w + 1) + 2 = budget with n_h = n_w r
    cells_h = cells_w * aspect
    if cells_w < 1:  # very tall: one cell wide, two positions per row
        return _grid(cell, (budget - 2) // 2 * cell, config)
    if cells_h < 1:  # very wide: one row
        return _grid((budget - 3) * cell, cell, config)
    beta = min(math.floor(cells_w) * cell / w, math.floor(cells_h) * cell / h)
    return _grid(math.floor(w * beta / p) * p, math.floor(h * beta / p) * p, config)


def span_roles(grid: ImageGrid) -> torch.Tensor:
    """int8 `[num_tokens]`: the role (START, IMAGE, NEWLINE, END) of each position of the span."""
    row = [IMAGE] * grid.n_w + [NEWLINE]
    return torch.tensor([START] + row * grid.n_h + [END], dtype=torch.int8)


def image_patches(image: Image, grid: ImageGrid, config: VisionConfig) -> torch.Tensor:
    """bf16 `[patch_h * patch_w, 3 * patch_size^2]`: the fitted, normalised pixels cut into
    patches (row-major grid order, each patch flattened channel-major)."""
    import numpy as np
    from PIL import ImageOps

    rgb = image.convert("RGB")
    squeeze = config.max_wh_ratio is not None and rgb.width >= config.max_wh_ratio * rgb.height
    # a squeezed image is stretched to the plan; any other is fitted with its aspect kept
    fitted = rgb.resize((grid.width, grid.height)) if squeeze else ImageOps.pad(rgb, (grid.width, grid.height),
                                                                                  color=GREY)
    pixels = torch.from_numpy(np.asarray(fitted, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    pixels = ((pixels - 0.5) / 0.5).to(torch.bfloat16)  # the reference rounds pixels to bf16
    p = config.patch_size
    return (pixels.reshape(3, grid.patch_h, p, grid.patch_w, p).permute(1, 3, 0, 2, 4)
            .reshape(grid.num_patches, config.patch_dim))


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the tower: its grid, its patches and a digest of the patches (two
    requests with the same image have the same digest; any pixel that differs changes it)."""

    grid: ImageGrid
    patches: torch.Tensor  # bf16 [num_patches, patch_dim]
    digest: str  # sha256 of the grid and the patch bytes

    @property
    def num_tokens(self) -> int:
        return self.grid.num_tokens


def preprocess_image(image: Image, config: VisionConfig) -> ProcessedImage:
    """Plan, fit, normalise and cut one PIL image (module docstring)."""
    grid = plan_image(image.width, image.height, config)
    patches = image_patches(image, grid, config)
    h = hashlib.sha256(f"{grid.patch_h}x{grid.patch_w}:".encode())
    h.update(patches.view(torch.int16).numpy().tobytes())
    return ProcessedImage(grid, patches, h.hexdigest())
