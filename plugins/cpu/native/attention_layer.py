"""The attention sub-layer of a decode step in two calls (attention_layer.c): attention_projections, its
input projections with their norms and rotaries, and attention_output, from the own keys' write to the output
projection. Each weight is bf16 (its packed copy, or for one token the plain weight: the GEMVs) or kept as
stored, FP8-block or FP4 codes (their products quant_gemv.c's, rounded to bf16 as the composed linear /
grouped_linear round them). DeepSeek-V4.1's run through them too (`q_head_norm=False`: its queries have no
per-head norm; `coded_keys=True`: its FP8 window and NVFP4 entry caches)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer.accelerator.quantized_weight import FP4_GROUP, QuantizedWeight
from deepinfer.models.deepseek_v41.kv_quant import FP8_WINDOW, NVFP4_COMPRESSED
from deepinfer_plugins.cpu.native.binding import Bound, Kernel, dtype_code, f32, threads
from deepinfer_plugins.cpu.native.packed_gemm import packed_shape

_ATTENTION_PROJECTIONS = Kernel("attention_projections")

_ATTENTION_OUTPUT = Kernel("attention_output")

# attention_layer.c's weight formats
_W_BF16, _W_FP8, _W_FP4 = 0, 1, 2


class WeightRef(ctypes.Structure):
    """attention_layer.c's `weight_ref`: a bf16 weight (`w`, or its `packed` copy) or FP8-block / FP4
    codes `w` with their scales (ue8m0 where `scale_e8m0`, else fp32) and FP8 block."""
    _fields_ = [("format", ctypes.c_int), ("w", ctypes.c_void_p), ("packed", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("scale_e8m0", ctypes.c_int), ("block", ctypes.c_long)]



def _bf16(t: torch.Tensor) -> bool:
    return t.dtype is torch.bfloat16 and t.is_cpu and t.is_contiguous() and not t.requires_grad


def _rotary_table(cos: torch.Tensor | None, sin: torch.Tensor | None, T: int, d: int) -> bool:
    """cos/sin `[T, half]` fp32-able CPU tables that the C rotary takes for rows of d features."""
    return (cos is not None and sin is not None and cos.dim() == 2 and cos.shape == sin.shape and cos.shape[0] == T
            and 0 < 2 * cos.shape[1] <= d and cos.is_cpu and sin.is_cpu)


def _projection_io(T: int, Nx: int, Nqr: int, heads: int, d: int, q_norm: torch.Tensor, kv_norm: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, index_heads: int, index_cos: torch.Tensor | None,
                   index_sin: torch.Tensor | None
                   ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]] | None:
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


def _weight(lib: ctypes.CDLL, weight: torch.Tensor | QuantizedWeight, packed: torch.Tensor | None, dims: int,
            tokens: int) -> tuple[tuple[int, ...], WeightRef, int] | None:
    """(the logical shape, the WeightRef, its address) of a `dims`-D weight: FP8-block or FP4 codes as stored
    (FP4 rows whole scale groups), or bf16 with its packed copy (pack_bf16's layout; of each group for a 3-D
    weight) or, for one token, without; None for anything else."""
    if isinstance(weight, QuantizedWeight):
        data, scale = weight.data, weight.scale
        if data.dim() != dims or not (data.is_cpu and scale.is_cpu and data.is_contiguous() and scale.is_contiguous()):
            return None
        fp4 = data.dtype is not torch.float8_e4m3fn
        shape = (*data.shape[:-1], data.shape[-1] * 2) if fp4 else tuple(data.shape)
        if fp4 and shape[-1] % FP4_GROUP:
            return None
        ref = WeightRef(_W_FP4 if fp4 else _W_FP8, data.data_ptr(), None, scale.data_ptr(),
                        int(scale.dtype is torch.float8_e8m0fnu), weight.block)
        return shape, ref, ctypes.addressof(ref)
    if not _bf16(weight) or weight.dim() != dims or packed is None and tokens != 1:
        return None
    if packed is not None and packed.shape != (*weight.shape[:-2], *packed_shape(lib, *weight.shape[-2:])):
        return None
    ref = WeightRef(_W_BF16, weight.data_ptr(), None if packed is None else packed.data_ptr(), None, 0, 0)
    return weight.shape, ref, ctypes.addressof(ref)


def attention_projections_arguments(lib: ctypes.CDLL, x: torch.Tensor, fused_x: torch.Tensor | QuantizedWeight,
                                    rank: int, q_norm: torch.Tensor, fused_qr: torch.Tensor | QuantizedWeight,
                                    heads: int, kv_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                                    index_heads: int, index_cos: torch.Tensor | None, index_sin: torch.Tensor | None,
                                    packed_x: torch.Tensor | None, packed_qr: torch.Tensor | None,
                                    q_head_norm: bool = True) -> Bound | None:
    """`attention_projections` (the interface's) of bf16 tokens `x [T, D]`, each weight FP8-block / FP4 codes
    or bf16 (its packed copy given, or None: the GEMV, one token). Without `q_head_norm` the query heads are
    only rotated (DeepSeek-V4.1's). The checked call (outputs: px, q, kv, the indexer's q), not made
    (binding.run makes it); None for anything else."""
    if x.dim() != 2 or not _bf16(x):
        return None
    T, D = x.shape
    wx, wqr = _weight(lib, fused_x, packed_x, 2, T), _weight(lib, fused_qr, packed_qr, 2, T)
    if wx is None or wqr is None:
        return None
    (Nx, in_x), (Nqr, in_qr), d = wx[0], wqr[0], kv_norm.shape[0]
    qn_dtype, kv_dtype = dtype_code(q_norm), dtype_code(kv_norm)
    if (in_x != D or in_qr != rank or not (0 < rank and rank + d <= Nx) or qn_dtype is None or kv_dtype is None
            or q_norm.shape != (rank,) or kv_norm.dim() != 1 or heads * d > Nqr or not _rotary_table(cos, sin, T, d)):
        return None
    io = _projection_io(T, Nx, Nqr, heads, d, q_norm, kv_norm, cos, sin, index_heads, index_cos, index_sin)
    if io is None:
        return None
    inputs, (px, q, kv, iq) = io
    qn, kn, cs, sn, ic, isn = inputs
    values = dict(x=x.data_ptr(), T=T, D=D, fx=wx[2], Nx=Nx, rank=rank, q_norm=qn.data_ptr(), qn_dtype=qn_dtype,
                  fqr=wqr[2], Nqr=Nqr, H=heads, d=d, q_head_norm=int(q_head_norm), kv_norm=kn.data_ptr(),
                  kv_dtype=kv_dtype, eps=eps, cos_t=cs.data_ptr(), sin_t=sn.data_ptr(), half=cos.shape[1],
                  Hi=index_heads, icos=ic.data_ptr(), isin=isn.data_ptr(), ihalf=ic.shape[1], px=px.data_ptr(),
                  q=q.data_ptr(), kv=kv.data_ptr(), iq=None if iq is None else iq.data_ptr(), num_threads=threads())
    return Bound(_ATTENTION_PROJECTIONS, values, (px, q, kv, iq), (*inputs, wx[1], wqr[1]))


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


def attention_output(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                     caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...], masks: tuple[torch.Tensor, ...],
                     sinks: torch.Tensor, scale: float, cos: torch.Tensor, sin: torch.Tensor,
                     wo_a: torch.Tensor | QuantizedWeight, wo_b: torch.Tensor | QuantizedWeight,
                     packed_wo_a: torch.Tensor | None, packed_wo_b: torch.Tensor | None, coded_keys: bool = False
                     ) -> torch.Tensor | None:
    """`decode_attention_output` (the interface's) of bf16 queries `q [B, H, d]` with bf16 caches (or, with
    `coded_keys`, DeepSeek-V4.1's FP8 window and NVFP4 entries, the own keys encoded), each weight FP8-block /
    FP4 codes (wo_a `[G, R, K]` per group) or bf16, its product on the packed copy given (pack_bf16 of wo_a's
    groups and of wo_b), else, for one token, on the plain weight (the GEMVs); None for anything else, with
    nothing written. IndexError for a key row outside its cache (the own keys then written, as the composed
    path does)."""
    bound = attention_output_arguments(lib, q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin, wo_a, wo_b,
                                       packed_wo_a, packed_wo_b, coded_keys)
    if bound is None:
        return None
    check_output_status(bound.call(lib), caches)
    return bound.outputs


def attention_output_arguments(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                               caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                               masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float, cos: torch.Tensor,
                               sin: torch.Tensor, wo_a: torch.Tensor | QuantizedWeight,
                               wo_b: torch.Tensor | QuantizedWeight, packed_wo_a: torch.Tensor | None,
                               packed_wo_b: torch.Tensor | None, coded_keys: bool = False) -> Bound | None:
    """`attention_output`'s checked call (outputs: the `[B, D]` result; its status goes to
    `check_output_status`), not made."""
    if q.dim() != 3 or not _bf16(q):
        return None
    B, H, d = q.shape
    wa, wb = _weight(lib, wo_a, packed_wo_a, 3, B), _weight(lib, wo_b, packed_wo_b, 2, B)
    if wa is None or wb is None:
        return None
    (G, R, K), (D, in_b) = wa[0], wb[0]
    if (G * K != H * d or in_b != G * R
            or not _keys_fit(q, kv, key_rows, caches, rows, masks, sinks, cos, sin, coded_keys)):
        return None
    keys, held = _key_arguments(q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin, coded_keys)
    out = torch.empty((B, D), dtype=torch.bfloat16)
    values = dict(keys, wo_a=wa[2], pa_size=0 if packed_wo_a is None else packed_wo_a.numel() // G, G=G, R=R,
                  wo_b=wb[2], D=D, out=out.data_ptr(), B=B, H=H, d=d, num_threads=threads())
    return Bound(_ATTENTION_OUTPUT, values, out, (*held, wa[1], wb[1]))
