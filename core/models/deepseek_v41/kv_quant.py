"""DeepSeek-V4.1's cache precision formats, as exact byte codecs and fake-quantise helpers.

V4.1 is trained with quantisation-aware caches, so these formats are part of the model, not an
engine choice. Every format works over the LAST dimension of a tensor, in consecutive blocks of
channels that share one scale:

* ``fp8`` (sliding-window KV): block 32. ``scale = 2**ceil(log2(max(amax, 1e-4) / 448))``, taken
  exactly from the IEEE-754 bits of the fp32 quotient (never through ``log2``, which rounds).
  Values ``clamp(x / scale, -448, 448)`` are cast to float8_e4m3fn (round to nearest even).
  Stored: one e4m3 byte per channel, then one ue8m0 byte per block (biased exponent ``e``,
  meaning ``2**(e - 127)``).
* ``nvfp4`` (compressed KV): block 16. ``scale = e4m3(max(amax, 6 * 2**-9) / 6)`` (round to
  nearest, not a power of two), stored as one e4m3 byte per block. Values ``clamp(x / scale,
  -6, 6)`` are rounded to the E2M1 grid ``{0, .5, 1, 1.5, 2, 3, 4, 6}`` (sign kept), to
  nearest with ties to the even code index.
* ``mxfp4`` (indexer q / k): block 32. ``scale`` is the exact power-of-two ceiling of
  ``max(amax, 6 * 2**-126) / 6``, stored as a ue8m0 byte; values as in ``nvfp4``.

A 4-bit code is ``sign << 3 | magnitude_index``; two codes share a byte, the LOW nibble holding
the even (lower-index) channel. A packed vector is all its codes first, then its scale bytes.
Dequantised values are ``code_value * scale`` computed in fp32 (exact), then cast to the
requested dtype. A final partial block is zero-padded internally (real configurations use whole
blocks). Behaviour on non-finite inputs (inf / NaN) is unspecified.

Scales are computed exactly as the released training code does (``amax * (1 / 448)``,
``amax * (1 / 6)`` and ``amax / 6`` in fp32), so :func:`fake_quantize` is bit-identical to the
reference ``quantize_cache``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["FORMATS", "KVFormat", "FP8_WINDOW", "NVFP4_COMPRESSED", "MXFP4_INDEX",
           "encode", "decode", "fake_quantize", "get_format"]

FORMATS = ("fp8", "nvfp4", "mxfp4")

_FP8_MAX = 448.0
_FP4_MAX = 6.0
_FP8_MIN_AMAX = 1e-4
_NVFP4_MIN_AMAX = 6 * 2.0 ** -9      # scale floor 2**-9: the smallest e4m3 subnormal
_MXFP4_MIN_AMAX = 6 * 2.0 ** -126    # scale floor 2**-126: the smallest normal fp32

# E2M1 rounding boundaries, split by which way a tie goes. Boundary i lies between magnitude
# indices i and i + 1; a tie goes to the even index, i.e. DOWN for even i and UP for odd i. So
# index = #(even-i boundaries strictly below |v|) + #(odd-i boundaries at or below |v|).
_TIE_DOWN_BOUNDS = (0.25, 1.25, 2.5, 5.0)   # boundaries 0, 2, 4, 6
_TIE_UP_BOUNDS = (0.75, 1.75, 3.5)          # boundaries 1, 3, 5
_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class KVFormat:
    """One cache precision format: its name (one of :data:`FORMATS`) and channels per scale."""

    name: str
    block: int

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise ValueError(f"unknown KV format {self.name!r}; expected one of {FORMATS}")
        if self.block <= 0 or (self.name != "fp8" and self.block % 2):
            raise ValueError(f"invalid block size {self.block} for format {self.name!r}")

    def num_blocks(self, channels: int) -> int:
        """Scale bytes per vector of ``channels`` channels (``ceil(channels / block)``)."""
        return -(-channels // self.block)

    def code_bytes(self, channels: int) -> int:
        """Value-code bytes per vector: one per channel for fp8, one per two channels for fp4."""
        return channels if self.name == "fp8" else -(-channels // 2)

    def bytes_per_vector(self, channels: int) -> int:
        """Packed bytes for one ``[channels]`` vector: codes plus one scale byte per block."""
        if channels < 0:
            raise ValueError(f"channels must be non-negative, got {channels}")
        return self.code_bytes(channels) + self.num_blocks(channels)


FP8_WINDOW = KVFormat("fp8", 32)
NVFP4_COMPRESSED = KVFormat("nvfp4", 16)
MXFP4_INDEX = KVFormat("mxfp4", 32)

_BY_NAME = {f.name: f for f in (FP8_WINDOW, NVFP4_COMPRESSED, MXFP4_INDEX)}


def get_format(name: str) -> KVFormat:
    """The model's format called ``name`` (``"fp8"``, ``"nvfp4"`` or ``"mxfp4"``)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown KV format {name!r}; expected one of {FORMATS}") from None


# ----------------------------------------------------------------------------------------------
# internals

class _PerDevice:
    """A small constant fp32 tensor, materialised once per device."""

    def __init__(self, values: tuple[float, ...]) -> None:
        self._values = values
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        t = self._by_device.get(device)
        if t is None:
            t = self._by_device[device] = torch.tensor(self._values, dtype=torch.float32,
                                                       device=device)
        return t


# code -> value: codes 0..7 are the non-negative levels, 8..15 the negated ones (8 is -0.0)
_E2M1_TABLE = _PerDevice(_E2M1_LEVELS + tuple(-v for v in _E2M1_LEVELS))


def _check_format(fmt: KVFormat) -> None:
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"fmt must be a KVFormat, got {type(fmt).__name__}")


def _grouped(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` ``[..., C]`` as fp32 ``[..., ceil(C / block), block]``, zero-padded at the end."""
    if not x.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("expected a tensor with a channel dimension")
    pad = -x.shape[-1] % block
    xf = x.float()
    if pad:
        xf = F.pad(xf, (0, pad))
    return xf.unflatten(-1, (-1, block))


def _pow2_ceil_exponent(v: torch.Tensor) -> torch.Tensor:
    """Biased exponent (int32) of the smallest power of two >= ``v`` (positive fp32), exactly:
    the exponent field, plus one when the mantissa field is non-zero."""
    bits = v.contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _exponent_to_scale(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**(exponent - 127)`` built from the bits (exponent in 1..254)."""
    return (exponent.to(torch.int32) << 23).view(torch.float32)


def _block_scales(grouped: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block (fp32 scale ``[..., G, 1]``, scale byte ``[..., G]`` uint8) of ``grouped``."""
    amax = grouped.abs().amax(-1, keepdim=True)
    if name == "nvfp4":
        scale8 = (amax.clamp_min(_NVFP4_MIN_AMAX) / _FP4_MAX).to(torch.float8_e4m3fn)
        return scale8.float(), scale8.view(torch.uint8).squeeze(-1)
    if name == "fp8":
        exponent = _pow2_ceil_exponent(amax.clamp_min(_FP8_MIN_AMAX) * (1 / _FP8_MAX))
    else:
        exponent = _pow2_ceil_exponent(amax.clamp_min(_MXFP4_MIN_AMAX) * (1 / _FP4_MAX))
    return _exponent_to_scale(exponent), exponent.squeeze(-1).to(torch.uint8)


def _e2m1_codes(normalized: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, ``sign << 3 | index``) of fp32 values already in [-6, 6].

    The magnitude index is a sum of seven threshold comparisons (``>`` where a tie rounds down,
    ``>=`` where it rounds up), which is cheaper on CPU than ``bucketize`` plus a tie fix-up."""
    mag = normalized.abs()
    index = torch.gt(mag, _TIE_DOWN_BOUNDS[0]).to(torch.uint8)
    for bound in _TIE_DOWN_BOUNDS[1:]:
        index += torch.gt(mag, bound)
    for bound in _TIE_UP_BOUNDS:
        index += torch.ge(mag, bound)
    index |= torch.signbit(normalized).to(torch.uint8) << 3
    return index


def _quantize_blocks(x: torch.Tensor, fmt: KVFormat):
    """Codes ``[..., G, block]`` (e4m3 for fp8, uint8 4-bit codes for fp4), fp32 scales
    ``[..., G, 1]`` and scale bytes ``[..., G]``."""
    _check_format(fmt)
    grouped = _grouped(x, fmt.block)
    scale, scale_bytes = _block_scales(grouped, fmt.name)
    if fmt.name == "fp8":
        codes = (grouped / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    else:
        codes = _e2m1_codes((grouped / scale).clamp_(-_FP4_MAX, _FP4_MAX))
    return codes, scale, scale_bytes


def _code_values(codes: torch.Tensor, name: str) -> torch.Tensor:
    """fp32 values of e4m3 codes (fp8) or uint8 4-bit codes (fp4)."""
    if name == "fp8":
        return codes.float()
    return torch.take(_E2M1_TABLE.get(codes.device), codes.long())


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, name: str, channels: int,
                dtype: torch.dtype) -> torch.Tensor:
    out = (_code_values(codes, name) * scale).flatten(-2)
    return out[..., :channels].to(dtype)


# ----------------------------------------------------------------------------------------------
# public API

def encode(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Quantise ``x`` ``[..., C]`` (any float dtype) to packed ``[..., fmt.bytes_per_vector(C)]``
    uint8: the value codes of all C channels first, then one scale byte per block."""
    channels = x.shape[-1] if x.dim() else 0
    codes, _, scale_bytes = _quantize_blocks(x, fmt)
    lead = codes.shape[:-2]
    if fmt.name == "fp8":
        code_bytes = codes.view(torch.uint8).flatten(-2)[..., :channels]
    else:
        flat = codes.flatten(-2)  # padded length is a multiple of the (even) block
        pairs = flat.unflatten(-1, (-1, 2))
        code_bytes = (pairs[..., 0] | (pairs[..., 1] << 4))[..., :fmt.code_bytes(channels)]
    return torch.cat([code_bytes.reshape(*lead, -1), scale_bytes.reshape(*lead, -1)], dim=-1)


def decode(packed: torch.Tensor, fmt: KVFormat, channels: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantise packed ``[..., fmt.bytes_per_vector(channels)]`` uint8 (from :func:`encode`)
    to ``[..., channels]`` of ``dtype``; values are ``code * scale`` computed exactly in fp32."""
    _check_format(fmt)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    nbytes = fmt.bytes_per_vector(channels)
    if packed.dim() == 0 or packed.shape[-1] != nbytes:
        raise ValueError(f"{fmt.name} with {channels} channels needs {nbytes} bytes per vector, "
                         f"got shape {tuple(packed.shape)}")
    n_code = fmt.code_bytes(channels)
    groups = fmt.num_blocks(channels)
    padded = groups * fmt.block
    code_bytes, scale_bytes = packed[..., :n_code], packed[..., n_code:]
    lead = packed.shape[:-1]
    if fmt.name == "fp8":
        flat = code_bytes
    else:
        flat = torch.stack([code_bytes & 0x0F, code_bytes >> 4], dim=-1).flatten(-2)
    if flat.shape[-1] < padded:  # a partial last block: pad with code 0 (value +0.0)
        flat = F.pad(flat, (0, padded - flat.shape[-1]))
    codes = flat.reshape(*lead, groups, fmt.block)
    if fmt.name == "fp8":
        codes = codes.contiguous().view(torch.float8_e4m3fn)
    if fmt.name == "nvfp4":
        scale = scale_bytes.contiguous().view(torch.float8_e4m3fn).float()
    else:
        scale = _exponent_to_scale(scale_bytes)
    return _dequantize(codes, scale.unsqueeze(-1), fmt.name, channels, dtype)


def fake_quantize(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``decode(encode(x, fmt), fmt, C, x.dtype)`` without the packing: the values the model
    reads back from its cache, same shape and dtype as ``x``."""
    codes, scale, _ = _quantize_blocks(x, fmt)
    return _dequantize(codes, scale, fmt.name, x.shape[-1], x.dtype)
