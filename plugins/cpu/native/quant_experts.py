"""quant_experts, the routed MoE experts of decode-sized batches on FP4 / FP8-block weights as stored
(quant_experts.c)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer.accelerator.quantized_weight import FP4_GROUP, QuantizedWeight
from deepinfer_plugins.cpu.native.binding import Kernel, dtype_code, threads

_QUANT_EXPERTS = Kernel("quant_experts")


def _stored(w: QuantizedWeight) -> bool:
    """A stacked expert weight the C code can index: on the CPU, codes and scales contiguous."""
    return (w.dim() == 3 and w.data.is_cpu and w.scale.is_cpu and w.data.is_contiguous()
            and w.scale.is_contiguous())


def expert_stacks(w13: QuantizedWeight, w2: QuantizedWeight, D: int) -> dict | None:
    """The C arguments (quant_experts' names) of routed expert stacks `w13 [E, 2I, D]`, `w2 [E, D, I]`,
    both FP4 or both FP8 blocks of one size, one scale dtype, stored so that the C code can index them;
    None for anything else."""
    if not isinstance(w13, QuantizedWeight) or not isinstance(w2, QuantizedWeight) or not _stored(w13) or not _stored(w2):
        return None
    E, two_i, _ = w13.shape
    inter = two_i // 2
    if (w13.kind != w2.kind or w13.scale.dtype != w2.scale.dtype or (w13.kind == "fp8" and w13.block != w2.block)
            or two_i % 2 or w13.shape != (E, two_i, D) or w2.shape != (E, D, inter)
            or (w13.kind == "fp4" and (D % FP4_GROUP or inter % FP4_GROUP))):
        return None
    return dict(E=E, fp4=int(w13.kind == "fp4"), w13=w13.data.data_ptr(), w13_stride=w13.data.stride(0),
                s13=w13.scale.data_ptr(), s13_stride=w13.scale.stride(0), w2=w2.data.data_ptr(),
                w2_stride=w2.data.stride(0), s2=w2.scale.data_ptr(), s2_stride=w2.scale.stride(0),
                scale_e8m0=int(w13.scale.dtype == torch.float8_e8m0fnu), block=w13.block, I=inter)


def quant_experts(lib: ctypes.CDLL, rows: torch.Tensor, tokens_per_expert: torch.Tensor, w13: QuantizedWeight,
                  w2: QuantizedWeight, limit: float, portable: bool = False) -> torch.Tensor | None:
    """The routed experts of rows grouped by expert (`rows [n, D]` fp32 or bf16, `w13 [E, 2I, D]`,
    `w2 [E, D, I]` both FP4 or both FP8 blocks of one size, one scale dtype), in rows' dtype; None
    for anything else. `portable` forces the plain C loops."""
    x_dtype = dtype_code(rows)
    if x_dtype is None or rows.dim() != 2 or not rows.is_contiguous():
        return None
    n, D = rows.shape
    stacks = expert_stacks(w13, w2, D)
    if stacks is None or tokens_per_expert.shape != (stacks["E"],) or not tokens_per_expert.is_cpu:
        return None
    counts = tokens_per_expert.to(torch.long).contiguous()
    out = torch.empty((n, D), dtype=rows.dtype)
    if n == 0:
        return out
    status = _QUANT_EXPERTS(lib, rows=rows.data_ptr(), x_dtype=x_dtype, n=n, D=D, counts=counts.data_ptr(), **stacks,
                            limit=limit, out=out.data_ptr(), portable=int(portable), num_threads=threads())
    return None if status else out  # counts that do not match the rows: the reference reports it
