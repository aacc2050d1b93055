"""Products of decode batches on weights packed once for the register tiles (packed_gemm.c):
pack_bf16 lays a bf16 weight out as column blocks with K in pairs, packed_linear_bf16 multiplies a few
rows by it."""
from __future__ import annotations

import ctypes
import functools

import torch

from deepinfer_plugins.cpu import huge_pages
from deepinfer_plugins.cpu.native.binding import Bound, Kernel, threads

_PACKED_COLS = Kernel("packed_cols")
_PACK_BF16 = Kernel("pack_bf16")
_PACKED_GEMM_BF16 = Kernel("packed_gemm_bf16")


@functools.cache
def packed_cols(lib: ctypes.CDLL) -> int:
    """The packed layout's block width in this build (16 with AVX512-BF16, else 8)."""
    return int(_PACKED_COLS(lib))


def packed_shape(lib: ctypes.CDLL, N: int, K: int) -> tuple[int, int, int, int]:
    """The shape of an `[N, K]` weight packed by `pack_bf16`: [column blocks, K pairs, block width, 2]."""
    cols = packed_cols(lib)
    return (-(-N // cols), (K + 1) // 2, cols, 2)


def pack_bf16(lib: ctypes.CDLL, weight: torch.Tensor, huge: bool = True) -> torch.Tensor | None:
    """A contiguous 2-D bf16 CPU `weight` [N, K] in the packed layout (a new bf16 tensor of about the
    same size: N rounded up to the block width, K to even), a 3-D one [G, N, K] (a stack of G matrices,
    the routed experts) as G such copies one after the other, or None for anything else. Copies of
    4 MB and more lie on huge pages (huge_pages.empty, unless `huge` is False): decode streams them from
    memory."""
    if (weight.dtype is not torch.bfloat16 or weight.dim() not in (2, 3) or not weight.is_cpu
            or not weight.is_contiguous() or weight.requires_grad or weight.numel() == 0):
        return None
    N, K = weight.shape[-2:]
    packed = huge_pages.empty((*weight.shape[:-2], *packed_shape(lib, N, K)), torch.bfloat16, huge)
    for w, p in zip(weight.view(-1, N, K), packed.view(-1, *packed_shape(lib, N, K))):
        _PACK_BF16(lib, W=w.data_ptr(), P=p.data_ptr(), N=N, K=K, num_threads=threads())
    return packed


def packed_linear_bf16(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, weight_shape: tuple[int, int]
                       ) -> torch.Tensor | None:
    """`x [M, K] @ W^T` -> `[M, N]` bf16 with `packed` = pack_bf16(W) and `weight_shape` = W's (N, K) (the
    packing pads K to even, so it does not tell K itself); None unless x is a 2-D bf16 CPU tensor of that K."""
    bound = packed_linear_arguments(lib, x, packed, weight_shape)
    if bound is None:
        return None
    if x.shape[0]:
        bound.call(lib)
    return bound.outputs


def packed_linear_arguments(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, weight_shape: tuple[int, int]
                            ) -> Bound | None:
    """`packed_linear_bf16`'s checked call (outputs: the `[M, N]` result), not made; None: not handled."""
    N, K = weight_shape
    if (x.dtype is not torch.bfloat16 or x.dim() != 2 or not x.is_cpu or x.requires_grad or x.shape[1] != K
            or packed.shape != packed_shape(lib, N, K)):
        return None
    xc = x.contiguous()
    out = torch.empty((x.shape[0], N), dtype=torch.bfloat16)
    values = dict(P=packed.data_ptr(), X=xc.data_ptr(), Y=out.data_ptr(), M=x.shape[0], N=N, K=x.shape[1],
                  num_threads=threads())
    return Bound(_PACKED_GEMM_BF16, values, out, (xc, packed))
