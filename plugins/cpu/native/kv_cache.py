"""kv_store: rows encoded in one of DeepSeek-V4.1's cache formats and written into cache rows (kv_cache.c,
the codecs of kv_codes.h: kv_quant.encode's bytes)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer.models.deepseek_v41.kv_quant import FP8_WINDOW, MXFP4_INDEX, NVFP4_COMPRESSED, KVFormat
from deepinfer_plugins.cpu.native.binding import Kernel, dtype_code

# kv_codes.h's formats by kv_quant's name
KV_CODES = {"fp8": 0, "nvfp4": 1, "mxfp4": 2}

_KV_STORE = Kernel("kv_store")


def codes_fit(fmt: KVFormat, channels: int) -> bool:
    """Whether the C codecs take rows of `channels` channels in `fmt` (one of V4.1's formats)."""
    return fmt in (FP8_WINDOW, NVFP4_COMPRESSED, MXFP4_INDEX) and channels > 0


def kv_store(lib: ctypes.CDLL, x: torch.Tensor, fmt: KVFormat, cache: torch.Tensor, dest: torch.Tensor) -> bool:
    """`cache[dest] = kv_quant.encode(x, fmt)` in place: x `[N, C]` (fp32 or bf16, rows may be a column slice),
    cache `[n, fmt.bytes_per_vector(C)]` uint8 contiguous, dest `[N]` int64. False (nothing written) for
    input the C code does not take; IndexError for a dest row outside the cache."""
    dtype = dtype_code(x)
    if dtype is None or x.dim() != 2 or x.stride(1) != 1 or not codes_fit(fmt, x.shape[1]):
        return False
    N, C = x.shape
    if (cache.dtype is not torch.uint8 or cache.dim() != 2 or cache.shape[1] != fmt.bytes_per_vector(C)
            or not cache.is_contiguous() or not cache.is_cpu or dest.shape != (N,) or dest.dtype is not torch.int64
            or not dest.is_cpu):
        return False
    d = dest.contiguous()
    if _KV_STORE(lib, x=x.data_ptr(), x_stride=x.stride(0), dtype=dtype, N=N, C=C, fmt=KV_CODES[fmt.name],
                 cache=cache.data_ptr(), n=cache.shape[0], dest=d.data_ptr()):
        raise IndexError(f"kv_store: a destination row is outside the cache ({cache.shape[0]} rows)")
    return True
