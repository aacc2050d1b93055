"""experts_bf16, the routed MoE experts of decode-sized batches (experts.c)."""
from __future__ import annotations

import ctypes

import torch

from deepinfer_plugins.cpu.native.binding import Kernel, threads

_EXPERTS_BF16 = Kernel("experts_bf16")


def experts_bf16(lib: ctypes.CDLL, rows: torch.Tensor, tokens_per_expert: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor, limit: float) -> torch.Tensor | None:
    """The routed experts of rows grouped by expert (`rows [n, D]`, `w13 [E, 2I, D]`, `w2 [E, D, I]`,
    bf16), or None for anything else."""
    E = w13.shape[0] if w13.dim() == 3 else -1
    if (any(t.dtype is not torch.bfloat16 or not t.is_cpu or t.requires_grad or not t.is_contiguous()
            for t in (rows, w13, w2)) or rows.dim() != 2 or w2.dim() != 3 or E < 1
            or w13.shape[2] != rows.shape[1] or w13.shape[1] % 2 or w2.shape != (E, rows.shape[1], w13.shape[1] // 2)
            or tokens_per_expert.shape != (E,) or not tokens_per_expert.is_cpu):
        return None
    n, D = rows.shape
    inter = w2.shape[2]
    counts = tokens_per_expert.to(torch.long).contiguous()
    gate_up = torch.empty((n, 2 * inter), dtype=torch.bfloat16)
    hidden = torch.empty((n, inter), dtype=torch.bfloat16)
    out = torch.empty((n, D), dtype=torch.bfloat16)
    status = _EXPERTS_BF16(lib, rows=rows.data_ptr(), n=n, D=D, counts=counts.data_ptr(), E=E, w13=w13.data_ptr(),
                           w2=w2.data_ptr(), I=inter, limit=limit, gate_up=gate_up.data_ptr(), hidden=hidden.data_ptr(),
                           out=out.data_ptr(), num_threads=threads())
    return None if status else out  # counts that do not match the rows: the reference reports it
