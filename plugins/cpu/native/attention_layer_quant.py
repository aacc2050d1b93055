"""The attention sub-layer of a decode step in two calls (attention_layer.c) where its weights are kept
as stored: attention_projections_quant and attention_output_quant, each weight FP8-block or FP4 codes
(their products quant_gemv.c's, rounded to bf16 as the composed linear / grouped_linear round them) or
bf16 (as attention_layer.py's bf16 calls take it)."""
from __future__ import annotations

import ctypes
import weakref

import torch

from deepinfer.accelerator.quantized_weight import FP4_GROUP, QuantizedWeight
from deepinfer_plugins.cpu.native.attention_layer import (_bf16, check_output_status, _key_arguments, _keys_fit,
                                                           _packed_fits, _projection_io, _rotary_table)
from deepinfer_plugins.cpu.native.binding import Bound, Kernel, dtype_code, threads
from deepinfer_plugins.cpu.native.packed_gemm import packed_shape

# attention_layer.c's weight formats
_W_BF16, _W_FP8, _W_FP4 = 0, 1, 2


class WeightRef(ctypes.Structure):
    """attention_layer.c's `weight_ref`: a bf16 weight (`w`, or its `packed` copy) or FP8-block / FP4
    codes `w` with their scales (ue8m0 where `scale_e8m0`, else fp32) and FP8 block."""
    _fields_ = [("format", ctypes.c_int), ("w", ctypes.c_void_p), ("packed", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("scale_e8m0", ctypes.c_int), ("block", ctypes.c_long)]


_ATTENTION_PROJECTIONS_QUANT = Kernel("attention_projections_quant")

_ATTENTION_OUTPUT_QUANT = Kernel("attention_output_quant")

# a quantised weight's (logical shape, WeightRef, its address), made at its first call: its storage never
# changes (QuantizedWeight is frozen), and the entry goes with the weight
_QUANT_REFS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _quant_ref(weight: QuantizedWeight, dims: int) -> tuple[tuple[int, ...], WeightRef, int] | None:
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


def _weight(weight: torch.Tensor | QuantizedWeight, packed: torch.Tensor | None, dims: int
            ) -> tuple[tuple[int, ...], WeightRef, int] | None:
    """(the logical shape, the WeightRef, its address) of a `dims`-D weight: FP8-block or FP4 codes as stored
    (FP4 rows whole scale groups), or bf16 with its packed copy or None; None for anything else."""
    if isinstance(weight, QuantizedWeight):
        entry = _QUANT_REFS.get(weight)
        if entry is None:
            entry = _quant_ref(weight, dims)
            if entry is None:
                return None
            _QUANT_REFS[weight] = entry
        return entry if len(entry[0]) == dims else None
    if not _bf16(weight) or weight.dim() != dims:
        return None
    ref = WeightRef(_W_BF16, weight.data_ptr(), None if packed is None else packed.data_ptr(), None, 0, 0)
    return weight.shape, ref, ctypes.addressof(ref)


def attention_projections_quant_arguments(lib: ctypes.CDLL, x: torch.Tensor, fused_x: torch.Tensor | QuantizedWeight,
                                          rank: int, q_norm: torch.Tensor, fused_qr: torch.Tensor | QuantizedWeight,
                                          heads: int, kv_norm: torch.Tensor, eps: float, cos: torch.Tensor,
                                          sin: torch.Tensor, index_heads: int, index_cos: torch.Tensor | None,
                                          index_sin: torch.Tensor | None, packed_x: torch.Tensor | None,
                                          packed_qr: torch.Tensor | None, q_head_norm: bool = True) -> Bound | None:
    """`attention_projections` (the interface's) of bf16 tokens `x [T, D]`, each weight FP8-block / FP4
    codes or bf16 (its packed copy given, or None: the GEMV, one token). Without `q_head_norm` the query heads
    are only rotated (DeepSeek-V4.1's). The checked call (outputs: px, q, kv, the indexer's q), not made
    (binding.run makes it); None for anything else."""
    if x.dim() != 2 or not _bf16(x):
        return None
    wx, wqr = _weight(fused_x, packed_x, 2), _weight(fused_qr, packed_qr, 2)
    if wx is None or wqr is None:
        return None
    T, D = x.shape
    (Nx, in_x), (Nqr, in_qr), d = wx[0], wqr[0], kv_norm.shape[0]
    qn_dtype, kv_dtype = dtype_code(q_norm), dtype_code(kv_norm)
    if (in_x != D or in_qr != rank or not (0 < rank and rank + d <= Nx) or qn_dtype is None or kv_dtype is None
            or q_norm.shape != (rank,) or kv_norm.dim() != 1 or heads * d > Nqr or not _rotary_table(cos, sin, T, d)
            or packed_x is None and wx[1].format == _W_BF16 and T != 1
            or packed_qr is None and wqr[1].format == _W_BF16 and T != 1
            or not (_packed_fits(lib, packed_x, fused_x) and _packed_fits(lib, packed_qr, fused_qr))):
        return None
    io = _projection_io(T, Nx, Nqr, heads, d, q_norm, kv_norm, cos, sin, index_heads, index_cos, index_sin)
    if io is None:
        return None
    inputs, (px, q, kv, iq) = io
    qn, kn, cs, sn, ic, isn = inputs
    values = dict(x=x.data_ptr(), T=T, D=D, fx=wx[2], Nx=Nx, rank=rank, q_norm=qn.data_ptr(), qn_dtype=qn_dtype,
                  fqr=wqr[2], Nqr=Nqr, H=heads, d=d, q_head_norm=int(q_head_norm), kv_norm=kn.data_ptr(), kv_dtype=kv_dtype, eps=eps,
                  cos_t=cs.data_ptr(), sin_t=sn.data_ptr(), half=cos.shape[1], Hi=index_heads, icos=ic.data_ptr(),
                  isin=isn.data_ptr(), ihalf=ic.shape[1], px=px.data_ptr(), q=q.data_ptr(), kv=kv.data_ptr(),
                  iq=None if iq is None else iq.data_ptr(), num_threads=threads())
    return Bound(_ATTENTION_PROJECTIONS_QUANT, values, (px, q, kv, iq), (*inputs, wx[1], wqr[1]))


def attention_output_quant(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                           caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                           masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float, cos: torch.Tensor,
                           sin: torch.Tensor, wo_a: torch.Tensor | QuantizedWeight,
                           wo_b: torch.Tensor | QuantizedWeight, packed_wo_a: torch.Tensor | None,
                           packed_wo_b: torch.Tensor | None, coded_keys: bool = False) -> torch.Tensor | None:
    """`decode_attention_output` (the interface's) of bf16 queries `q [B, H, d]` with bf16 caches (or V4.1's
    coded ones: `coded_keys`, as attention_output_bf16), each weight FP8-block / FP4 codes (wo_a `[G, R, K]`
    per group) or bf16 (as attention_output_bf16 takes it); None for anything else, with nothing written.
    IndexError for a key row outside its cache (the own keys then written, as the composed path does)."""
    bound = attention_output_quant_arguments(lib, q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin, wo_a,
                                             wo_b, packed_wo_a, packed_wo_b, coded_keys)
    if bound is None:
        return None
    check_output_status(bound.call(lib), caches)
    return bound.outputs


def attention_output_quant_arguments(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, key_rows: torch.Tensor,
                                     caches: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                                     masks: tuple[torch.Tensor, ...], sinks: torch.Tensor, scale: float,
                                     cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor | QuantizedWeight,
                                     wo_b: torch.Tensor | QuantizedWeight, packed_wo_a: torch.Tensor | None,
                                     packed_wo_b: torch.Tensor | None, coded_keys: bool = False) -> Bound | None:
    """`attention_output_quant`'s checked call (outputs: the `[B, D]` result; its status goes to
    `check_output_status`), not made."""
    if q.dim() != 3 or not _bf16(q):
        return None
    wa, wb = _weight(wo_a, packed_wo_a, 3), _weight(wo_b, packed_wo_b, 2)
    if wa is None or wb is None:
        return None
    B, H, d = q.shape
    (G, R, K), (D, in_b) = wa[0], wb[0]
    if (G * K != H * d or in_b != G * R
            or not _keys_fit(q, kv, key_rows, caches, rows, masks, sinks, cos, sin, coded_keys)):
        return None
    if B != 1 and (packed_wo_a is None and wa[1].format == _W_BF16 or packed_wo_b is None and wb[1].format == _W_BF16):
        return None
    if packed_wo_a is not None and packed_wo_a.shape != (G, *packed_shape(lib, R, K)):
        return None
    if not _packed_fits(lib, packed_wo_b, wo_b):
        return None
    keys, held = _key_arguments(q, kv, key_rows, caches, rows, masks, sinks, scale, cos, sin, coded_keys)
    out = torch.empty((B, D), dtype=torch.bfloat16)
    values = dict(keys, wo_a=wa[2], pa_size=0 if packed_wo_a is None else packed_wo_a.numel() // G, G=G, R=R,
                  wo_b=wb[2], D=D, out=out.data_ptr(), B=B, H=H, d=d, num_threads=threads())
    return Bound(_ATTENTION_OUTPUT_QUANT, values, out, (*held, wa[1], wb[1]))
