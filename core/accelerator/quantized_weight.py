"""Block-scaled weight formats, and `QuantizedWeight`: a linear weight kept in its checkpoint format.

The formats (as DeepSeek's official checkpoints ship them, V4 and later):

* **FP8 block** (`fp8_block<B>`): storage float8 e4m3 `[..., out, in]`, one scale per BxB block,
  scale shape `[..., ceil(out/B), ceil(in/B)]`. Real value = fp8 * scale. B = 128 for V4
  (`fp8_block128`), 32 for V4.1 (`fp8_block32`).
* **FP4** (`fp4_e2m1`): storage int8 `[..., out, in/2]`, two e2m1 codes per byte, the LOW nibble
  holding the even (lower-index) element; one scale per 32 inputs, shape `[..., out, in/32]`.
* **FP8 rows** (V4.1's Engram tables, read by row look-ups, never by a linear): float8 e4m3
  `[rows, cols]`, one scale per row and 32 columns (`dequantize_fp8_rows`).

Scales are ue8m0 (`float8_e8m0fnu`: 2^(byte-127)) in official checkpoints, fp32 in some (V4-Flash-Base
experts); both mean "multiply by this". Dequantisation computes in fp32 (exact: a code times a power
of two) and rounds once to the requested dtype.

This module is part of the accelerator contract: a back end that declares a format in
`Capabilities.weight_formats` receives the weights of that format as `QuantizedWeight`s in `linear`,
`grouped_linear` and `moe_experts` (`deepinfer.accelerator.reference` has the dequantise-tile-by-tile
implementation). It lives in the accelerator layer so that the reference kernels can read it; the
checkpoint loaders (`deepinfer.models.common`) build the objects.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

FP8_BLOCK = 128  # rows and columns per FP8 scale block (V4; V4.1 uses 32)
FP4_GROUP = 32  # inputs per FP4 scale
FP8_ROW_GROUP = 32  # columns per scale of a row-scaled FP8 table

FP8_BLOCK128 = "fp8_block128"  # V4's dense projections (and V4-Flash-Base's experts)
FP8_BLOCK32 = "fp8_block32"  # V4.1's dense projections
FP4_E2M1 = "fp4_e2m1"  # V4 and V4.1 routed experts
#: The formats DeepSeek's checkpoints ship; `Capabilities.weight_formats` accepts these (and any
#: other `fp8_block<B>`).
WEIGHT_FORMATS = (FP8_BLOCK128, FP8_BLOCK32, FP4_E2M1)
_FORMAT_RE = re.compile(r"^(fp8_block[1-9][0-9]*|fp4_e2m1)$")

# e2m1 magnitudes indexed by the low three bits of a code; bit 3 is the sign.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_TABLE = torch.tensor(list(FP4_E2M1_VALUES) + [-v for v in FP4_E2M1_VALUES], dtype=torch.float32)

FP8_DTYPES = (torch.float8_e4m3fn,)
FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float32)


def is_weight_format(name: str) -> bool:
    """Whether `name` spells a weight format (`fp8_block<B>` or `fp4_e2m1`)."""
    return isinstance(name, str) and _FORMAT_RE.match(name) is not None


def quant_format(weight_dtype: torch.dtype) -> str:
    """'fp8' or 'fp4' for a quantised weight's storage dtype; ValueError for anything else."""
    if weight_dtype in FP8_DTYPES:
        return "fp8"
    if weight_dtype in FP4_DTYPES:
        return "fp4"
    raise ValueError(
        f"a weight with a scale tensor must be float8_e4m3fn (FP8 block) or int8/uint8/float4_e2m1fn_x2 "
        f"(packed FP4); got {weight_dtype}")


def format_name(weight_dtype: torch.dtype, block: int = FP8_BLOCK) -> str:
    """The `Capabilities.weight_formats` name of a stored weight: `fp8_block<block>` or `fp4_e2m1`."""
    return f"fp8_block{block}" if quant_format(weight_dtype) == "fp8" else FP4_E2M1


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


def check_scale(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> None:
    want = expected_scale_shape(tuple(weight.shape), weight.dtype, block)
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit a {quant_format(weight.dtype)} weight "
                         f"of shape {tuple(weight.shape)}; expected {want}")


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                         block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 e4m3 `[..., out, in]` with `block` x `block` scales -> `dtype` (computed in fp32, exact)."""
    check_scale(weight, scale, block)
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
    return _FP4_TABLE.to(packed.device)[codes].flatten(-2)


def dequantize_fp4(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
                   ) -> torch.Tensor:
    """Packed FP4 `[..., out, in/2]` with one scale per 32 inputs `[..., out, in/32]` -> `dtype`."""
    check_scale(weight, scale)
    values = unpack_fp4(weight)
    s = scale_to_float(scale).repeat_interleave(FP4_GROUP, dim=-1)
    return (values * s).to(dtype)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               block: int = FP8_BLOCK) -> torch.Tensor:
    """Dispatch on the weight's storage dtype (FP8 block of size `block`, or packed FP4)."""
    if quant_format(weight.dtype) == "fp8":
        return dequantize_fp8_block(weight, scale, dtype, block)
    return dequantize_fp4(weight, scale, dtype)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A weight `[..., out, in]` (logical shape) kept in its checkpoint format.

    `data` is the storage (FP8 e4m3 `[..., out, in]` or packed FP4 `[..., out, in/2]`), `scale` its
    scales (ue8m0 or fp32, shapes as in the module docstring), `block` the FP8 block size (ignored
    for FP4, whose group is always 32), `dtype` the float dtype it stands for: the model's compute
    dtype, what `dequantize()` returns by default. Leading dims stack experts (`[E, out, in]`) or
    groups (`[G, out, in]`). Construction checks every shape and dtype (ValueError naming the fix).
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.data.dim() < 2:
            raise ValueError(f"a quantised weight needs at least 2 dims [out, in]; got {tuple(self.data.shape)}")
        kind = quant_format(self.data.dtype)  # ValueError for a non-quantised storage dtype
        if kind == "fp8" and (not isinstance(self.block, int) or self.block <= 0):
            raise ValueError(f"an FP8 block weight needs a positive block size; got {self.block!r}")
        if self.scale.dtype not in SCALE_DTYPES:
            raise ValueError(f"quantisation scales must be float8_e8m0fnu (ue8m0) or float32; got {self.scale.dtype}")
        if not self.dtype.is_floating_point or self.dtype.itemsize < 2:
            raise ValueError(f"a quantised weight stands for a float32, bfloat16 or float16 tensor; got {self.dtype}")
        check_scale(self.data, self.scale, self.block)

    # ----- description -----
    @property
    def kind(self) -> str:
        """'fp8' or 'fp4'."""
        return quant_format(self.data.dtype)

    @property
    def format(self) -> str:
        """The `Capabilities.weight_formats` name: `fp8_block<B>` or `fp4_e2m1`."""
        return format_name(self.data.dtype, self.block)

    @property
    def shape(self) -> torch.Size:
        """The logical (dequantised) shape."""
        return torch.Size(dequantized_shape(tuple(self.data.shape), self.data.dtype))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return self.data.dim()

    @property
    def nbytes(self) -> int:
        """Bytes held: storage plus scales."""
        return self.data.nbytes + self.scale.nbytes

    def __repr__(self) -> str:
        return (f"QuantizedWeight({self.format}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"scale={self.scale.dtype}, device={self.device})")

    # ----- values -----
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as a `dtype` tensor (default `self.dtype`), computed in fp32 (exact), rounded once."""
        return dequantize(self.data, self.scale, dtype or self.dtype, self.block)

    # ----- views (no copy) -----
    @property
    def row_align(self) -> int:
        """Rows per scale row: a row slice must start at a multiple of this."""
        return self.block if self.kind == "fp8" else 1

    def __getitem__(self, index: int) -> QuantizedWeight:
        """One expert / group of a stacked weight `[E, out, in]`."""
        if self.data.dim() < 3 or not isinstance(index, int):
            raise TypeError(f"a QuantizedWeight is indexed by an int over its leading (expert or group) dim; "
                            f"got {index!r} for shape {tuple(self.shape)}")
        return QuantizedWeight(self.data[index], self.scale[index], self.block, self.dtype)

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Rows [start, stop) of the output dim (dim -2). FP8: `start` must be a multiple of the block."""
        rows = self.shape[-2]
        if not 0 <= start < stop <= rows or start % self.row_align:
            raise ValueError(f"rows [{start}, {stop}) of a {self.format} weight of {rows} rows: the range must lie "
                             f"inside and start at a multiple of {self.row_align}")
        a = self.row_align
        scale_rows = slice(start // a, -(-stop // a)) if self.kind == "fp8" else slice(start, stop)
        return QuantizedWeight(self.data[..., start:stop, :], self.scale[..., scale_rows, :], self.block, self.dtype)

    def row_tiles(self, max_elements: int) -> list[tuple[int, int]]:
        """Row ranges covering the output dim, each at most ~`max_elements` logical elements (and at
        least one scale row), starting at multiples of `row_align`."""
        rows, cols = self.shape[-2], self.shape[-1]
        a = self.row_align
        step = max(a, (max_elements // max(cols, 1)) // a * a)
        return [(r, min(r + step, rows)) for r in range(0, rows, step)]

    def unflatten_rows(self, groups: int) -> QuantizedWeight:
        """`[groups * R, in]` -> `[groups, R, in]`. FP8 needs R to be a multiple of the block
        (`can_unflatten_rows`)."""
        if not self.can_unflatten_rows(groups):
            raise ValueError(f"cannot split the {self.shape[-2]} rows of a {self.format} weight into {groups} "
                             f"groups of whole scale blocks; dequantise it instead")
        return QuantizedWeight(self.data.unflatten(0, (groups, -1)), self.scale.unflatten(0, (groups, -1)),
                               self.block, self.dtype)

    def can_unflatten_rows(self, groups: int) -> bool:
        rows = self.shape[-2]
        return self.data.dim() == 2 and rows % groups == 0 and (rows // groups) % self.row_align == 0

    # ----- copies -----
    def copy_to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> QuantizedWeight:
        """A copy on `device` in memory of its own (contiguous; never still a checkpoint's memory map),
        standing for `dtype` (default: unchanged)."""
        def own(t: torch.Tensor) -> torch.Tensor:
            out = t.to(device)
            return out.clone(memory_format=torch.contiguous_format) if out.data_ptr() == t.data_ptr() else \
                out.contiguous()
        return QuantizedWeight(own(self.data), own(self.scale), self.block, dtype or self.dtype)


def _same_format(parts: list[QuantizedWeight]) -> bool:
    first = parts[0]
    return all(p.format == first.format and p.scale.dtype == first.scale.dtype and p.dtype == first.dtype
               and p.device == first.device for p in parts)


def can_cat_rows(parts: list) -> bool:
    """Whether `cat_rows(parts)` can concatenate them without dequantising: all QuantizedWeights of one
    format, scale dtype and input size, and (FP8) every part but the last a whole number of blocks."""
    if not parts or not all(isinstance(p, QuantizedWeight) and p.dim() == 2 for p in parts) or not _same_format(parts):
        return False
    if len({p.shape[-1] for p in parts}) != 1:
        return False
    return all(p.shape[-2] % p.row_align == 0 for p in parts[:-1])


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The parts' rows concatenated into one quantised weight (see `can_cat_rows`)."""
    if not can_cat_rows(parts):
        raise ValueError(f"cannot concatenate {parts} quantised: formats, input sizes or block alignment differ")
    first = parts[0]
    return QuantizedWeight(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]),
                           first.block, first.dtype)


def stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Equal-shaped quantised weights stacked along a new leading dim (experts `[E, out, in]`)."""
    if not parts or not all(isinstance(p, QuantizedWeight) for p in parts) or not _same_format(parts) \
            or len({tuple(p.data.shape) for p in parts}) != 1:
        raise ValueError("cannot stack quantised weights of different formats or shapes")
    first = parts[0]
    return QuantizedWeight(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]),
                           first.block, first.dtype)


def weight_nbytes(t: torch.Tensor | QuantizedWeight) -> int:
    """Bytes a loaded weight holds (a QuantizedWeight's storage plus scales)."""
    return t.nbytes if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()
