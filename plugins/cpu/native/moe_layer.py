"""moe_layer_bf16, the MoE sub-layer of a decode step in one call (moe_layer.c)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer_plugins.cpu.native.binding import Kernel, float_, int_, long_, ptr, threads

_MOE_LAYER_BF16 = Kernel("moe_layer_bf16", restype=ctypes.c_int, x=ptr, T=long_, D=long_, gate=ptr, bias=ptr,
                         hash_ids=ptr, E=long_, k=long_, scaling=float_, scoring=int_, w13=ptr, w2=ptr, I=long_,
                         sw13=ptr, sw2=ptr, SI=long_, limit=float_, round_silu=int_, out=ptr,
                         num_threads=int_)

#: the router scoring functions the C code knows (moe_layer.c's SCORE_*)
SCORING_CODES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


def _usable(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype is dtype and t.is_cpu and t.is_contiguous() and not t.requires_grad


def moe_layer_bf16(lib: ctypes.CDLL, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                   hash_ids: torch.Tensor | None, w13: torch.Tensor, w2: torch.Tensor,
                   shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None, top_k: int,
                   routed_scaling_factor: float, scoring_func: str, swiglu_limit: float,
                   round_silu: bool = False) -> torch.Tensor | None:
    """The MoE sub-layer (`MoEOps.moe_sublayer`) of a few bf16 tokens `x [T, D]` with bf16 experts, an
    fp32 router; None for anything else (or a hash id outside the experts: the reference reports it).
    `round_silu`: the shared expert's swiglu rounds where torch's bf16 ops do (silu, then the product),
    else once, as the C swiglu and expert kernels."""
    scoring = SCORING_CODES.get(scoring_func)
    if (scoring is None or x.dim() != 2 or not _usable(x, torch.bfloat16) or not _usable(gate, torch.float32)
            or not (_usable(w13, torch.bfloat16) and _usable(w2, torch.bfloat16)) or w13.dim() != 3):
        return None
    T, D = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    if (gate.shape != (E, D) or w13.shape[2] != D or two_i % 2 or w2.shape != (E, D, inter)
            or not 0 < top_k <= E):
        return None
    if bias is not None and not (_usable(bias, torch.float32) and bias.shape == (E,)):
        return None
    if hash_ids is not None:
        if hash_ids.shape != (T, top_k) or not hash_ids.is_cpu:
            return None
        hash_ids = hash_ids.long().contiguous()
    shared_inter = 0
    if shared_w13 is not None:
        if shared_w2 is None or not (_usable(shared_w13, torch.bfloat16) and _usable(shared_w2, torch.bfloat16)):
            return None
        shared_inter = shared_w2.shape[1]
        if shared_w13.shape != (2 * shared_inter, D) or shared_w2.shape != (D, shared_inter):
            return None
    out = torch.empty((T, D), dtype=torch.bfloat16)
    status = _MOE_LAYER_BF16(
        lib, x=x.data_ptr(), T=T, D=D, gate=gate.data_ptr(), bias=None if bias is None else bias.data_ptr(),
        hash_ids=None if hash_ids is None else hash_ids.data_ptr(), E=E, k=top_k, scaling=routed_scaling_factor,
        scoring=scoring, w13=w13.data_ptr(), w2=w2.data_ptr(), I=inter,
        sw13=None if shared_w13 is None else shared_w13.data_ptr(),
        sw2=None if shared_w2 is None else shared_w2.data_ptr(), SI=shared_inter, limit=swiglu_limit,
        round_silu=int(round_silu), out=out.data_ptr(), num_threads=threads())
    return None if status else out
