"""attention_output_bf16, a decode step's attention from the own keys' write to the output projection
in one call (attention_layer.c)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer_plugins.cpu.native.binding import Kernel, f32, float_, int_, long_, ptr, threads
from deepinfer_plugins.cpu.native.packed_gemm import packed_shape

_ATTENTION_OUTPUT_BF16 = Kernel(
    "attention_output_bf16", ctypes.c_int, q=ptr, kv=ptr, window=ptr, n0=long_, key_rows=ptr, rows0=ptr, mask0=ptr,
    L0=long_, cache1=ptr, rows1=ptr, mask1=ptr, n1=long_, L1=long_, sinks=ptr, scale=float_, cos_t=ptr, sin_t=ptr,
    half=long_, wo_a=ptr, pwo_a=ptr, pa_size=long_, G=long_, R=long_, wo_b=ptr, pwo_b=ptr, D=long_, out=ptr, B=long_,
    H=long_, d=long_, num_threads=int_)


def _bf16(t: torch.Tensor) -> bool:
    return t.dtype is torch.bfloat16 and t.is_cpu and t.is_contiguous() and not t.requires_grad


def _part(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether one (cache, rows, mask) key part is what the C call reads for queries `q [B, H, d]`: a
    contiguous cache `[n, d]` of q's dtype, int64 rows `[B, L]`, bool mask `[B, 1, L]` (sink_attention_rows'
    parts, S = 1)."""
    B, _, d = q.shape
    return (cache.dtype == q.dtype and cache.dim() == 2 and cache.shape[1] == d and cache.is_cpu
            and cache.is_contiguous() and rows.dtype == torch.int64 and rows.dim() == 2 and rows.shape[0] == B
            and mask.dtype == torch.bool and mask.shape == (B, 1, rows.shape[1]))


def attention_output_bf16(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                          caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                          masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float, cos: torch.Tensor,
                          sin: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor,
                          packed_wo_a: torch.Tensor | None, packed_wo_b: torch.Tensor | None
                          ) -> torch.Tensor | None:
    """`decode_attention_output` (the interface's) of bf16 queries `q [B, H, d]` with bf16 caches and
    weights, the products on the packed copies given (pack_bf16 of wo_a's groups and of wo_b), else,
    for one token, on the plain weights (the GEMVs); None for anything else, with nothing written.
    IndexError for a key row outside its cache (the own keys then written, as the composed path does)."""
    if q.dim() != 3 or not all(_bf16(t) for t in (q, wo_a, wo_b)) or wo_a.dim() != 3 or wo_b.dim() != 2:
        return None
    B, H, d = q.shape
    G, R, K = wo_a.shape
    if (G * K != H * d or wo_b.shape[1] != G * R or not 1 <= len(caches) <= 2 or len(rows) != len(caches)
            or len(masks) != len(caches) or sinks.shape != (H,) or kv.shape != (B, d) or kv.dtype is not q.dtype
            or key_rows.shape != (B,) or key_rows.dtype is not torch.int64 or not key_rows.is_cpu
            or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != B or not 0 < 2 * cos.shape[1] <= d
            or not cos.is_cpu or not sin.is_cpu):
        return None
    if not all(_part(q, c, r, m) for c, r, m in zip(caches, rows, masks)):
        return None
    if (packed_wo_a is None or packed_wo_b is None) and B != 1:
        return None
    if packed_wo_a is not None and packed_wo_a.shape != (G, *packed_shape(lib, R, K)):
        return None
    if packed_wo_b is not None and packed_wo_b.shape != packed_shape(lib, *wo_b.shape):
        return None
    parts = [(c, r.contiguous(), m.contiguous()) for c, r, m in zip(caches, rows, masks)]
    c0, r0, m0 = parts[0]
    c1, r1, m1 = parts[1] if len(parts) == 2 else parts[0]
    L1 = r1.shape[1] if len(parts) == 2 else 0
    kvc, kr, s, cs, sn = kv.contiguous(), key_rows.contiguous(), f32(sinks), f32(cos), f32(sin)
    out = torch.empty((B, wo_b.shape[0]), dtype=torch.bfloat16)
    status = _ATTENTION_OUTPUT_BF16(
        lib, q=q.data_ptr(), kv=kvc.data_ptr(), window=c0.data_ptr(), n0=c0.shape[0], key_rows=kr.data_ptr(),
        rows0=r0.data_ptr(), mask0=m0.data_ptr(), L0=r0.shape[1], cache1=c1.data_ptr(), rows1=r1.data_ptr(),
        mask1=m1.data_ptr(), n1=c1.shape[0], L1=L1, sinks=s.data_ptr(), scale=scale, cos_t=cs.data_ptr(),
        sin_t=sn.data_ptr(), half=cos.shape[1], wo_a=wo_a.data_ptr(),
        pwo_a=None if packed_wo_a is None else packed_wo_a.data_ptr(),
        pa_size=0 if packed_wo_a is None else packed_wo_a.numel() // G, G=G, R=R, wo_b=wo_b.data_ptr(),
        pwo_b=None if packed_wo_b is None else packed_wo_b.data_ptr(), D=wo_b.shape[0], out=out.data_ptr(), B=B,
        H=H, d=d, num_threads=threads())
    if status == -1:
        raise IndexError(f"decode_attention_output: an own key's row is outside the window cache (size "
                         f"{c0.shape[0]}); the step plan's key rows must address the bound cache")
    if status:
        raise IndexError(f"decode_attention_output: a key row is outside its cache (sizes "
                         f"{[c.shape[0] for c in caches]}); the step plan's key rows must address the bound cache")
    return out
