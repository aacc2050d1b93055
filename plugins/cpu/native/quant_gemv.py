"""Decode-sized products on FP4 / FP8 weights kept in their checkpoint format (quant_gemv.c)."""
from __future__ import annotations

import ctypes
import functools

import torch

from deepinfer.accelerator.quantized_weight import FP4_GROUP, QuantizedWeight
from deepinfer_plugins.cpu.native.binding import DTYPE_CODES, Kernel, dtype_code, threads

_FP4_LINEAR = Kernel("fp4_linear")
_FP8_LINEAR = Kernel("fp8_linear")
_QUANT_GROUPED_LINEAR = Kernel("quant_grouped_linear")
_QUANT_SIMD = Kernel("quant_simd")


@functools.cache
def quant_simd(lib: ctypes.CDLL) -> bool:
    """The library has the AVX2 + FMA loops (else only the portable ones)."""
    return bool(_QUANT_SIMD(lib))


def quant_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: QuantizedWeight, portable: bool = False,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """`x @ weight.T` (`[rows, out]`, fp32 sums rounded once to `out_dtype`, fp32 or bf16) for a 2-D
    fp32/bf16 `x` and a 2-D FP4 or FP8-block `QuantizedWeight` on the CPU, or None for anything else.
    `portable` forces the plain C loops."""
    x_dtype, y_dtype = dtype_code(x), DTYPE_CODES.get(out_dtype)
    data, scale = weight.data, weight.scale
    if (x_dtype is None or y_dtype is None or x.dim() != 2 or data.dim() != 2 or x.stride(-1) != 1
            or not (data.is_cpu and scale.is_cpu) or not data.is_contiguous() or not scale.is_contiguous()):
        return None
    fp4 = data.dtype is not torch.float8_e4m3fn
    rows, in_, out = x.shape[0], x.shape[1], data.shape[0]
    if in_ != (data.shape[1] * 2 if fp4 else data.shape[1]):
        return None
    y = torch.empty((rows, out), dtype=out_dtype)
    if rows == 0 or out == 0:
        return y
    args = dict(x=x.data_ptr(), x_dtype=x_dtype, x_stride=x.stride(0), rows=rows, in_=in_, w=data.data_ptr(),
                scale=scale.data_ptr(), scale_e8m0=int(scale.dtype is torch.float8_e8m0fnu), out=out,
                y=y.data_ptr(), y_dtype=y_dtype, portable=int(portable), num_threads=threads())
    if fp4:
        if in_ % FP4_GROUP:
            return None
        _FP4_LINEAR(lib, **args)
    else:
        _FP8_LINEAR(lib, **args, block=weight.block)
    return y


def quant_grouped_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: QuantizedWeight,
                         out_dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """The grouped projection `y[:, g] = x[:, g] @ weight[g].T` (`x [rows, G, in]` fp32/bf16, `weight
    [G, out, in]` FP4 or FP8 blocks) -> `[rows, G, out]` in `out_dtype` (fp32 or bf16): each group
    quant_linear's products, in one call; None for anything else."""
    x_dtype, y_dtype = dtype_code(x), DTYPE_CODES.get(out_dtype)
    data, scale = weight.data, weight.scale
    if (x_dtype is None or y_dtype is None or x.dim() != 3 or data.dim() != 3 or not x.is_contiguous()
            or not (data.is_cpu and scale.is_cpu) or not data.is_contiguous() or not scale.is_contiguous()):
        return None
    fp4 = data.dtype is not torch.float8_e4m3fn
    rows, groups, in_ = x.shape
    out = data.shape[1]
    if groups != data.shape[0] or in_ != (data.shape[2] * 2 if fp4 else data.shape[2]) or (fp4 and in_ % FP4_GROUP):
        return None
    y = torch.empty((rows, groups, out), dtype=out_dtype)
    if y.numel():
        _QUANT_GROUPED_LINEAR(lib, fp4=int(fp4), x=x.data_ptr(), x_dtype=x_dtype, rows=rows, G=groups, in_=in_,
                              w=data.data_ptr(), scale=scale.data_ptr(), scale_group=scale.stride(0),
                              scale_e8m0=int(scale.dtype is torch.float8_e8m0fnu), block=weight.block, out=out,
                              y=y.data_ptr(), y_dtype=y_dtype, num_threads=threads())
    return y
