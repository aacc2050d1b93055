"""Quantised weight formats: dequantise on load, quantise for test checkpoints.

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

import math

import torch

FP8_BLOCK = 128  # rows and columns per FP8 scale block (V4; V4.1 uses 32)
FP4_GROUP = 32  # inputs per FP4 scale
FP8_ROW_GROUP = 32  # columns per scale of a row-scaled FP8 table

# e2m1 magnitudes indexed by the low three bits of a code; bit 3 is the sign.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_TABLE = torch.tensor(list(FP4_E2M1_VALUES) + [-v for v in FP4_E2M1_VALUES], dtype=torch.float32)

FP8_DTYPES = (torch.float8_e4m3fn,)
FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)


def quant_format(weight_dtype: torch.dtype) -> str:
    """'fp8' or 'fp4' for a quantised weight's storage dtype; ValueError for anything else."""
    if weight_dtype in FP8_DTYPES:
        return "fp8"
    if weight_dtype in FP4_DTYPES:
        return "fp4"
    raise ValueError(
        f"a weight with a scale tensor must be float8_e4m3fn (FP8 block) or int8/uint8/float4_e2m1fn_x2 "
        f"(packed FP4); got {weight_dtype}")


def expected_scale_shape(weight_shape: tuple[int, ...], weight_dtype: torch.dtype, block: int = FP8_BLOCK
                         ) -> tuple[int, ...]:
    """The scale shape a quantised weight of this storage shape/dtype must come with (`block`: the
    FP8 block size)."""
    *lead, rows, cols = weight_shape
    if quant_format(weight_dtype) == "fp8":
        return (*lead, math.ceil(rows / block), math.ceil(cols / block))
    return (*lead, rows, cols * 2 // FP4_GROUP)


def dequantized_shape(weight_shape: tuple[int, ...], weight_dtype: torch.dtype) -> tuple[int, ...]:
    """The logical (unpacked) shape of a quantised weight."""
    *lead, rows, cols = weight_shape
    return tuple(weight_shape) if quant_format(weight_dtype) == "fp8" else (*lead, rows, cols * 2)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scale factors as fp32; ue8m0 bytes become exact powers of two."""
    return scale.to(torch.float32)


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                         block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 e4m3 `[..., out, in]` with `block` x `block` scales -> `dtype` (computed in fp32, exact)."""
    _check_scale(weight, scale, block)
    rows, cols = weight.shape[-2:]
    s = scale_to_float(scale)
    s = s.repeat_interleave(block, dim=-2)[..., :rows, :].repeat_interleave(block, dim=-1)[..., :cols]
    return (weight.to(torch.float32) * s).to(dtype)


def dequantize_fp8_rows(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
                        ) -> torch.Tensor:
    """Row-scaled FP8 e4m3 `[..., rows, cols]` with scales `[..., rows, cols/32]` -> `dtype`."""
    want = (*weight.shape[:-1], weight.shape[-1] // FP8_ROW_GROUP)
    if weight.dtype not in FP8_DTYPES or weight.shape[-1] % FP8_ROW_GROUP or tuple(scale.shape) != want:
        raise ValueError(f"a row-scaled FP8 table must be float8_e4m3fn with a multiple of {FP8_ROW_GROUP} "
                         f"columns and scales of shape {want}; got {weight.dtype} {tuple(weight.shape)} and "
                         f"scales {tuple(scale.shape)}")
    s = scale_to_float(scale).repeat_interleave(FP8_ROW_GROUP, dim=-1)
    return (weight.to(torch.float32) * s).to(dtype)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 bytes `[..., n]` -> fp32 values `[..., 2n]`; the low nibble is the even element."""
    if packed.dtype == torch.float4_e2m1fn_x2:
        packed = packed.view(torch.uint8)
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1)  # (even, odd) per byte
    return _FP4_TABLE[codes].flatten(-2)


def dequantize_fp4(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
                   ) -> torch.Tensor:
    """Packed FP4 `[..., out, in/2]` with one scale per 32 inputs `[..., out, in/32]` -> `dtype`."""
    _check_scale(weight, scale)
    values = unpack_fp4(weight)
    s = scale_to_float(scale).repeat_interleave(FP4_GROUP, dim=-1)
    return (values * s).to(dtype)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               block: int = FP8_BLOCK) -> torch.Tensor:
    """Dispatch on the weight's storage dtype (FP8 block of size `block`, or packed FP4)."""
    if quant_format(weight.dtype) == "fp8":
        return dequantize_fp8_block(weight, scale, dtype, block)
    return dequantize_fp4(weight, scale, dtype)


def _check_scale(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> None:
    want = expected_scale_shape(tuple(weight.shape), weight.dtype, block)
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit a {quant_format(weight.dtype)} weight "
                         f"of shape {tuple(weight.shape)}; expected {want}")


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
