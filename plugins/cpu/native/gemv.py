"""The bf16 decode products (gemv.c): gemv_bf16 (gemv_tier names its instruction-set tier),
grouped_gemv_bf16, and, where the CPU has AMX, grouped_amx_bf16 and linear_amx_bf16 on its tiles;
linear_rows, the batch-invariant product."""
from __future__ import annotations

import ctypes
import functools

import torch

from deepinfer_plugins.cpu.native.binding import DTYPE_CODES, Bound, Kernel, dtype_code, threads

_AMX_USABLE = Kernel("amx_usable")
_GEMV_TIER = Kernel("gemv_tier")
_GEMV_BF16 = Kernel("gemv_bf16")
_GROUPED_GEMV_BF16 = Kernel("grouped_gemv_bf16")
_GROUPED_AMX_BF16 = Kernel("grouped_amx_bf16")


@functools.cache
def amx_usable(lib: ctypes.CDLL) -> bool:
    """The library was built for a CPU with AMX and Linux granted this process the AMX state (asked
    once per library)."""
    return bool(_AMX_USABLE(lib))


@functools.cache
def gemv_tier(lib: ctypes.CDLL) -> str:
    """The bf16 dot-product tier the library's decode products were compiled with: "avx512-bf16",
    "avx2-fma" or "portable" (gemv.h)."""
    return _GEMV_TIER(lib).decode()


def gemv_tier_for(isa: frozenset[str]) -> str:
    """The tier gemv.h compiles for a build targeting `isa` (build_isa names)."""
    return "avx512-bf16" if "avx512bf16" in isa else "avx2-fma" if {"avx2", "fma"} <= isa else "portable"


def gemv_bf16_arguments(lib: ctypes.CDLL, weight: torch.Tensor, x: torch.Tensor) -> Bound | None:
    """`weight @ x` for one bf16 token (x `[K]` or `[1, K]`) -> `[N]`: the checked call (outputs: the `[N]`
    result), not made (binding.run makes it); None for anything else."""
    if (weight.dtype is not torch.bfloat16 or x.dtype is not torch.bfloat16 or weight.dim() != 2
            or x.numel() != weight.shape[1] or not (weight.is_cpu and x.is_cpu) or not weight.is_contiguous()
            or weight.requires_grad or x.requires_grad):
        return None
    xc = x.reshape(-1)
    if xc.stride(0) != 1:
        xc = xc.contiguous()
    out = torch.empty(weight.shape[0], dtype=torch.bfloat16)
    values = dict(W=weight.data_ptr(), x=xc.data_ptr(), y=out.data_ptr(), N=weight.shape[0], K=weight.shape[1],
                  num_threads=threads())
    return Bound(_GEMV_BF16, values, out, (xc,))


_GEMV_TOKENS_BF16 = Kernel("gemv_tokens_bf16")


def gemv_tokens_bf16(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`x [m, K] @ weight [N, K]^T` for a few bf16 tokens, each weight block streamed once for all of
    them; None for anything else."""
    if (x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or x.dim() != 2 or weight.dim() != 2
            or x.shape[1] != weight.shape[1] or not (x.is_cpu and weight.is_cpu) or not weight.is_contiguous()
            or x.requires_grad or weight.requires_grad):
        return None
    xc = x.contiguous()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)
    _GEMV_TOKENS_BF16(lib, W=weight.data_ptr(), X=xc.data_ptr(), Y=out.data_ptr(), m=x.shape[0], N=weight.shape[0],
                      K=weight.shape[1], num_threads=threads())
    return out


def grouped_gemv_bf16(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """One bf16 token's grouped projection: x `[1, G, K]`, weight `[G, N, K]` -> `[1, G, N]`; else None."""
    if (x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or x.dim() != 3 or weight.dim() != 3
            or x.shape[0] != 1 or x.shape[1:] != (weight.shape[0], weight.shape[2]) or not (x.is_cpu and weight.is_cpu)
            or not weight.is_contiguous() or x.requires_grad or weight.requires_grad):
        return None
    G, N, K = weight.shape
    xc = x.contiguous()
    out = torch.empty((1, G, N), dtype=torch.bfloat16)
    _GROUPED_GEMV_BF16(lib, W=weight.data_ptr(), X=xc.data_ptr(), Y=out.data_ptr(), G=G, N=N, K=K,
                       num_threads=threads())
    return out


def grouped_amx_bf16(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """A few tokens' grouped projection on AMX tiles: x `[T, G, K]`, weight `[G, N, K]` -> `[T, G, N]`;
    None without AMX or for shapes the tiles do not cover."""
    if (not amx_usable(lib) or x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or x.dim() != 3
            or weight.dim() != 3 or x.shape[1:] != (weight.shape[0], weight.shape[2]) or not (x.is_cpu and weight.is_cpu)
            or not weight.is_contiguous() or x.requires_grad or weight.requires_grad
            or weight.shape[1] % 64 or weight.shape[2] % 32):
        return None
    T, G, K = x.shape
    N = weight.shape[1]
    xg = x.transpose(0, 1).contiguous()  # [G, T, K]: each group's tokens together
    out = torch.empty((G, T, N), dtype=torch.bfloat16)
    _GROUPED_AMX_BF16(lib, W=weight.data_ptr(), G=G, N=N, K=K, X=xg.data_ptr(), T=T, Y=out.data_ptr(),
                      num_threads=threads())
    return out.transpose(0, 1)


def linear_amx_bf16(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`x [m, K] @ weight [N, K]^T` on AMX tiles (`grouped_amx_bf16` with one group), or None without
    AMX or for shapes they do not cover."""
    if (not amx_usable(lib) or x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or x.dim() != 2
            or weight.dim() != 2 or x.shape[1] != weight.shape[1] or not (x.is_cpu and weight.is_cpu)
            or not weight.is_contiguous() or x.requires_grad or weight.requires_grad or weight.shape[0] % 64
            or weight.shape[1] % 32):
        return None
    xc = x.contiguous()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)
    _GROUPED_AMX_BF16(lib, W=weight.data_ptr(), G=1, N=weight.shape[0], K=weight.shape[1], X=xc.data_ptr(),
                      T=x.shape[0], Y=out.data_ptr(), num_threads=threads())
    return out


_LINEAR_ROWS = Kernel("linear_rows")


def linear_rows(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
                ) -> torch.Tensor | None:
    """`x [..., K] @ weight [N, K]^T` with every output reduced in one fixed order over K whatever the
    number of rows (the batch-invariant product); fp32 or bf16 operands, the result in `out_dtype`
    (default x's). None for input the C code does not handle."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    x_code, w_code, y_code = dtype_code(x), dtype_code(weight), DTYPE_CODES.get(out_dtype)
    if (x_code is None or w_code is None or y_code is None or weight.dim() != 2 or x.shape[-1] != weight.shape[1]
            or x.dim() < 1):
        return None
    K, N = weight.shape[1], weight.shape[0]
    xc, wc = x.reshape(-1, K).contiguous(), weight.contiguous()
    out = torch.empty((xc.shape[0], N), dtype=out_dtype)
    if xc.shape[0] and N:
        _LINEAR_ROWS(lib, W=wc.data_ptr(), w_dtype=w_code, X=xc.data_ptr(), x_dtype=x_code, Y=out.data_ptr(),
                     y_dtype=y_code, M=xc.shape[0], N=N, K=K, num_threads=threads())
    return out.view(*x.shape[:-1], N)
