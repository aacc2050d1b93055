"""The attention sub-layer of a decode step in two calls (attention_layer.c): attention_projections_bf16,
its input projections with their norms and rotaries, and attention_output_bf16, from the own keys' write
to the output projection. DeepSeek-V4.1's run through them too (`q_head_norm=False`: its queries have
no per-head norm; `coded_keys=True`: its FP8 window and NVFP4 entry caches)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer.models.deepseek_v41.kv_quant import FP8_WINDOW, NVFP4_COMPRESSED
from deepinfer_plugins.cpu.native.binding import Bound, Kernel, dtype_code, f32, threads
from deepinfer_plugins.cpu.native.packed_gemm import packed_shape

_ATTENTION_OUTPUT_BF16 = Kernel("attention_output_bf16")

_ATTENTION_PROJECTIONS_BF16 = Kernel("attention_projections_bf16")


def _bf16(t: torch.Tensor) -> bool:
    return t.dtype is torch.bfloat16 and t.is_cpu and t.is_contiguous() and not t.requires_grad


def _rotary_table(cos: torch.Tensor | None, sin: torch.Tensor | None, T: int, d: int) -> bool:
    """cos/sin `[T, half]` fp32-able CPU tables that the C rotary takes for rows of d features."""
    return (cos is not None and sin is not None and cos.dim() == 2 and cos.shape == sin.shape and cos.shape[0] == T
            and 0 < 2 * cos.shape[1] <= d and cos.is_cpu and sin.is_cpu)


def _packed_fits(lib: ctypes.CDLL, packed: torch.Tensor | None, weight: torch.Tensor) -> bool:
    return packed is None or packed.shape == packed_shape(lib, *weight.shape)


def _projection_io(T: int, Nx: int, Nqr: int, heads: int, d: int, q_norm: torch.Tensor, kv_norm: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, index_heads: int, index_cos: torch.Tensor | None,
                   index_sin: torch.Tensor | None) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]] | None:
    """The projections call's norm and rotary inputs (q_norm, kv_norm, cos, sin, the indexer's cos, sin) as C
    reads them and its new outputs (px, q, kv, the indexer's q or None); None where the indexer's heads do not
    split the rest of the fused query projection or their rotary table does not fit."""
    di = 0
    if index_heads:
        di = (Nqr - heads * d) // index_heads
        if di * index_heads != Nqr - heads * d or not _rotary_table(index_cos, index_sin, T, di):
            return None
    cs, sn = f32(cos), f32(sin)
    ic, isn = (f32(index_cos), f32(index_sin)) if index_heads else (cs, sn)
    outputs = (torch.empty((T, Nx), dtype=torch.bfloat16), torch.empty((T, heads, d), dtype=torch.bfloat16),
               torch.empty((T, d), dtype=torch.bfloat16),
               torch.empty((T, index_heads, di), dtype=torch.bfloat16) if index_heads else None)
    return (q_norm.contiguous(), kv_norm.contiguous(), cs, sn, ic, isn), outputs


def attention_projections_arguments(lib: ctypes.CDLL, x: torch.Tensor, fused_x: torch.Tensor, rank: int,
                                    q_norm: torch.Tensor, fused_qr: torch.Tensor, heads: int, kv_norm: torch.Tensor,
                                    eps: float, cos: torch.Tensor, sin: torch.Tensor, index_heads: int,
                                    index_cos: torch.Tensor | None, index_sin: torch.Tensor | None,
                                    packed_x: torch.Tensor | None, packed_qr: torch.Tensor | None,
                                    q_head_norm: bool = True) -> Bound | None:
    """`attention_projections` (the interface's) of bf16 tokens `x [T, D]` with bf16 weights, each product
    on its packed copy when given, else (one token) on the plain weight. Without `q_head_norm` the query heads
    are only rotated (DeepSeek-V4.1's). The checked call (outputs: px, q, kv, the indexer's q), not made
    (binding.run makes it); None for anything else."""
    if x.dim() != 2 or not all(_bf16(t) for t in (x, fused_x, fused_qr)) or fused_x.dim() != 2 or fused_qr.dim() != 2:
        return None
    T, D = x.shape
    (Nx, _), (Nqr, _), d = fused_x.shape, fused_qr.shape, kv_norm.shape[0]
    qn_dtype, kv_dtype = dtype_code(q_norm), dtype_code(kv_norm)
    if (fused_x.shape[1] != D or fused_qr.shape[1] != rank or not (0 < rank and rank + d <= Nx) or qn_dtype is None
            or kv_dtype is None or q_norm.shape != (rank,) or kv_norm.dim() != 1 or heads * d > Nqr
            or not _rotary_table(cos, sin, T, d) or (packed_x is None or packed_qr is None) and T != 1
            or not (_packed_fits(lib, packed_x, fused_x) and _packed_fits(lib, packed_qr, fused_qr))):
        return None
    io = _projection_io(T, Nx, Nqr, heads, d, q_norm, kv_norm, cos, sin, index_heads, index_cos, index_sin)
    if io is None:
        return None
    inputs, (px, q, kv, iq) = io
    qn, kn, cs, sn, ic, isn = inputs
    values = dict(x=x.data_ptr(), T=T, D=D, fused_x=fused_x.data_ptr(),
                  pfx=None if packed_x is None else packed_x.data_ptr(), Nx=Nx, rank=rank, q_norm=qn.data_ptr(),
                  qn_dtype=qn_dtype, fused_qr=fused_qr.data_ptr(),
                  pfqr=None if packed_qr is None else packed_qr.data_ptr(), Nqr=Nqr, H=heads, d=d,
                  q_head_norm=int(q_head_norm), kv_norm=kn.data_ptr(), kv_dtype=kv_dtype, eps=eps, cos_t=cs.data_ptr(), sin_t=sn.data_ptr(),
                  half=cos.shape[1], Hi=index_heads, icos=ic.data_ptr(), isin=isn.data_ptr(), ihalf=ic.shape[1],
                  px=px.data_ptr(), q=q.data_ptr(), kv=kv.data_ptr(), iq=None if iq is None else iq.data_ptr(),
                  num_threads=threads())
    return Bound(_ATTENTION_PROJECTIONS_BF16, values, (px, q, kv, iq), inputs)


def _part(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor, width: int | None) -> bool:
    """Whether one (cache, rows, mask) key part is what the C call reads for queries `q [B, H, d]`: a
    contiguous cache `[n, d]` of q's dtype (or, `width` given, uint8 `[n, width]`: packed rows), int64 rows
    `[B, L]`, bool mask `[B, 1, L]` (sink_attention_rows' parts, S = 1)."""
    B, _, d = q.shape
    dtype, row = (q.dtype, d) if width is None else (torch.uint8, width)
    return (cache.dtype == dtype and cache.dim() == 2 and cache.shape[1] == row and cache.is_cpu
            and cache.is_contiguous() and rows.dtype == torch.int64 and rows.dim() == 2 and rows.shape[0] == B
            and mask.dtype == torch.bool and mask.shape == (B, 1, rows.shape[1]))


def _keys_fit(q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor, caches: tuple[torch.Tensor, ...],
              rows: tuple[torch.Tensor, ...], masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, coded_keys: bool = False) -> bool:
    """Whether the output call's query side (own keys, their rows, sinks, rotary table) and its one or two
    key parts are what the C code reads for queries `q [B, H, d]`; with `coded_keys`, V4.1's FP8 window
    and NVFP4 entries."""
    B, H, d = q.shape
    widths = ((FP8_WINDOW.bytes_per_vector(d), NVFP4_COMPRESSED.bytes_per_vector(d)) if coded_keys else (None, None))
    return (1 <= len(caches) <= 2 and len(rows) == len(caches) and len(masks) == len(caches) and sinks.shape == (H,)
            and kv.shape == (B, d) and kv.dtype is q.dtype and key_rows.shape == (B,)
            and key_rows.dtype is torch.int64 and key_rows.is_cpu and cos.dim() == 2 and cos.shape == sin.shape
            and cos.shape[0] == B and 0 < 2 * cos.shape[1] <= d and cos.is_cpu and sin.is_cpu
            and all(_part(q, c, r, m, w) for c, r, m, w in zip(caches, rows, masks, widths)))


def _key_arguments(q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor, caches: tuple[torch.Tensor, ...],
                   rows: tuple[torch.Tensor, ...], masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float,
                   cos: torch.Tensor, sin: torch.Tensor, coded_keys: bool = False
                   ) -> tuple[dict, tuple[torch.Tensor, ...]]:
    """The output calls' keyword arguments of the query side and the key parts (L1 = 0 where there is one
    part only), and the tensors made here, which the caller holds until the call returns."""
    parts = [(c, r.contiguous(), m.contiguous()) for c, r, m in zip(caches, rows, masks)]
    c0, r0, m0 = parts[0]
    c1, r1, m1 = parts[1] if len(parts) == 2 else parts[0]
    kvc, kr, s, cs, sn = kv.contiguous(), key_rows.contiguous(), f32(sinks), f32(cos), f32(sin)
    keep = (r0, m0, r1, m1, kvc, kr, s, cs, sn)
    return dict(q=q.data_ptr(), kv=kvc.data_ptr(), window=c0.data_ptr(), n0=c0.shape[0], key_rows=kr.data_ptr(),
                rows0=r0.data_ptr(), mask0=m0.data_ptr(), L0=r0.shape[1], cache1=c1.data_ptr(), rows1=r1.data_ptr(),
                mask1=m1.data_ptr(), n1=c1.shape[0], L1=r1.shape[1] if len(parts) == 2 else 0,
                coded_keys=int(coded_keys), sinks=s.data_ptr(),
                scale=scale, cos_t=cs.data_ptr(), sin_t=sn.data_ptr(), half=cos.shape[1]), keep


def check_output_status(status: int, caches: tuple[torch.Tensor, ...]) -> None:
    """The output call's status: IndexError for a key row outside its cache (the own keys then written)."""
    if status == -1:
        raise IndexError(f"decode_attention_output: an own key's row is outside the window cache (size "
                         f"{caches[0].shape[0]}); the step plan's key rows must address the bound cache")
    if status:
        raise IndexError(f"decode_attention_output: a key row is outside its cache (sizes "
                         f"{[c.shape[0] for c in caches]}); the step plan's key rows must address the bound cache")


def attention_output_bf16(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                          caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                          masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float, cos: torch.Tensor,
                          sin: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor,
                          packed_wo_a: torch.Tensor | None, packed_wo_b: torch.Tensor | None, coded_keys: bool = False
                          ) -> torch.Tensor | None:
    """`decode_attention_output` (the interface's) of bf16 queries `q [B, H, d]` with bf16 caches (or, with
    `coded_keys`, DeepSeek-V4.1's FP8 window and NVFP4 entries, the own keys encoded) and bf16 weights, the
    products on the packed copies given (pack_bf16 of wo_a's groups and of wo_b), else, for one token, on
    the plain weights (the GEMVs); None for anything else, with nothing written. IndexError for a key row
    outside its cache (the own keys then written, as the composed path does)."""
    bound = attention_output_arguments(lib, q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin, wo_a, wo_b,
                                       packed_wo_a, packed_wo_b, coded_keys)
    if bound is None:
        return None
    check_output_status(bound.call(lib), caches)
    return bound.outputs


def attention_output_arguments(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                               caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                               masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float, cos: torch.Tensor,
                               sin: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor,
                               packed_wo_a: torch.Tensor | None, packed_wo_b: torch.Tensor | None,
                               coded_keys: bool = False) -> Bound | None:
    """`attention_output_bf16`'s checked call (outputs: the `[B, D]` result; its status goes to
    `check_output_status`), not made."""
    if q.dim() != 3 or not all(_bf16(t) for t in (q, wo_a, wo_b)) or wo_a.dim() != 3 or wo_b.dim() != 2:
        return None
    B, H, d = q.shape
    G, R, K = wo_a.shape
    if (G * K != H * d or wo_b.shape[1] != G * R
            or not _keys_fit(q, kv, key_rows, caches, rows, masks, sinks, cos, sin, coded_keys)):
        return None
    if (packed_wo_a is None or packed_wo_b is None) and B != 1:
        return None
    if packed_wo_a is not None and packed_wo_a.shape != (G, *packed_shape(lib, R, K)):
        return None
    if not _packed_fits(lib, packed_wo_b, wo_b):
        return None
    keys, held = _key_arguments(q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin, coded_keys)
    out = torch.empty((B, wo_b.shape[0]), dtype=torch.bfloat16)
    values = dict(keys, wo_a=wo_a.data_ptr(), pwo_a=None if packed_wo_a is None else packed_wo_a.data_ptr(),
                  pa_size=0 if packed_wo_a is None else packed_wo_a.numel() // G, G=G, R=R, wo_b=wo_b.data_ptr(),
                  pwo_b=None if packed_wo_b is None else packed_wo_b.data_ptr(), D=wo_b.shape[0], out=out.data_ptr(),
                  B=B, H=H, d=d, num_threads=threads())
    return Bound(_ATTENTION_OUTPUT_BF16, values, out, held)
