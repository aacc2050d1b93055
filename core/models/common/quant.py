"""Quantised weight formats: dequantise on load, quantise for test checkpoints.

The formats, their dequantisation and `QuantizedWeight` (a weight kept quantised in memory) live in
`deepinfer.accelerator.quantized_weight` and are re-exported here; this module adds the quantisers.

Two block-scaled formats, as DeepSeek's official checkpoints ship them (V4 and later):

* **FP8 block**: weight in float8 e4m3 `[out, in]`, one scale per BxB block, scale shape
  `[ceil(out/B), ceil(in/B)]`. Real value = fp8 * scale. B is the checkpoint's
  `quantization_config.weight_block_size` (128 for V4, 32 for V4.1); every FP8-block function takes
  it as `block` (default `FP8_BLOCK` = 128).
* **FP8 rows** (V4.1's Engram tables): weight in float8 e4m3 `[rows, cols]`, one scale per row and
  32 columns, shape `[rows, cols/32]` (`quantize_fp8_rows` / `dequantize_fp8_rows`).
* **FP4 experts** (`expert_dtype: fp4`): weight int8 `[out, in/2]`, two e2m1 codes per byte with the
  LOW nibble holding the even (lower-index) element; one scale per 32 inputs, shape `[out, in/32]`.

Scales are ue8m0 (`float8_e8m0fnu`: value 2^(byte-127)) in official checkpoints, fp32 in some
(V4-Flash-Base experts, HF's `weight_scale_inv`); both mean "multiply by this". Both formats also
appear with leading batch dims (HF's fused experts `[E, out, in]`), which the functions accept.

The format is chosen from the weight's dtype, never guessed from shapes alone: a generic FP8
dequantiser applied to packed FP4 bytes (two codes per byte) silently loses half the weights.
"""
from __future__ import annotations

import torch

# the formats and their exact dequantisation are part of the accelerator contract (back ends that
# declare a format receive `QuantizedWeight`s); re-exported here for the loaders and make-model
from deepinfer.accelerator.quantized_weight import (  # noqa: F401  (re-exported)
    _FP4_TABLE, FP4_DTYPES, FP4_E2M1_VALUES, FP4_GROUP, FP8_BLOCK, FP8_DTYPES, FP8_ROW_GROUP, QuantizedWeight,
    dequantize, dequantize_fp4, dequantize_fp8_block, dequantize_fp8_rows, dequantized_shape, expected_scale_shape,
    format_name, quant_format, scale_to_float, unpack_fp4,
)
from deepinfer.accelerator.quantized_weight import check_scale as _check_scale  # noqa: F401  (re-exported)


# --- quantisation (writes the official format; used by make_model for loader tests) ---------------

def _pow2_scale(absmax: torch.Tensor, max_code: float) -> torch.Tensor:
    """Smallest power-of-two scale with absmax / scale <= max_code, as ue8m0."""
    exponent = torch.ceil(torch.log2(absmax.clamp_min(1e-30) / max_code)).clamp(-127, 127)
    return torch.exp2(exponent).to(torch.float8_e8m0fnu)


def quantize_fp8_block(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` float -> (float8_e4m3fn weight, ue8m0 scale `[ceil(out/block), ceil(in/block)]`)."""
    w = weight.to(torch.float32)
    rows, cols = w.shape
    pr, pc = -rows % block, -cols % block
    padded = torch.nn.functional.pad(w, (0, pc, 0, pr))
    blocks = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    absmax = blocks.abs().amax(dim=(1, 3))
    scale = _pow2_scale(absmax, torch.finfo(torch.float8_e4m3fn).max)
    s = scale.to(torch.float32).repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (w / s).to(torch.float8_e4m3fn), scale


def quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[rows, cols]` float (cols divisible by 32) -> (float8_e4m3fn table, ue8m0 scale `[rows, cols/32]`)."""
    w = weight.to(torch.float32)
    rows, cols = w.shape
    if cols % FP8_ROW_GROUP:
        raise ValueError(f"row-scaled FP8 needs the column count divisible by {FP8_ROW_GROUP}; got {cols}")
    groups = w.view(rows, cols // FP8_ROW_GROUP, FP8_ROW_GROUP)
    scale = _pow2_scale(groups.abs().amax(dim=-1), torch.finfo(torch.float8_e4m3fn).max)
    return (groups / scale.to(torch.float32).unsqueeze(-1)).view(rows, cols).to(torch.float8_e4m3fn), scale


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` float (in divisible by 32) -> (int8 packed `[out, in/2]`, ue8m0 scale `[out, in/32]`).

    Each value is rounded to the nearest e2m1 code (ties to the lower magnitude).
    """
    w = weight.to(torch.float32)
    rows, cols = w.shape
    if cols % FP4_GROUP:
        raise ValueError(f"FP4 quantisation needs the input dim divisible by {FP4_GROUP}; got {cols}")
    groups = w.view(rows, cols // FP4_GROUP, FP4_GROUP)
    scale = _pow2_scale(groups.abs().amax(dim=-1), FP4_E2M1_VALUES[-1])
    scaled = (groups / scale.to(torch.float32).unsqueeze(-1)).view(rows, cols)
    magnitudes = torch.tensor(FP4_E2M1_VALUES)
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # nearest magnitude
    codes = index | ((scaled < 0) & (index > 0)).to(torch.int64) << 3
    pairs = codes.view(rows, cols // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale
