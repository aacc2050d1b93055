"""argmax_logsumexp, greedy sampling's token and log-normaliser (sampling.c)."""
from __future__ import annotations

import ctypes
import math

import torch

from deepinfer_plugins.cpu.native.binding import Kernel, threads

_ARGMAX_LOGSUMEXP = Kernel("argmax_logsumexp")


def argmax_logsumexp(lib: ctypes.CDLL, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of fp32 logits `[L, V]`: first maximal index and log-sum-exp, or None for other input."""
    if (logits.dtype is not torch.float32 or logits.dim() != 2 or not logits.is_cpu or logits.requires_grad
            or logits.shape[1] == 0 or logits.stride(1) != 1):
        return None
    L, V = logits.shape
    index = torch.empty(L, dtype=torch.long)
    log_norm = torch.empty(L, dtype=torch.float32)
    _ARGMAX_LOGSUMEXP(lib, logits=logits.data_ptr(), L=L, V=V, stride=logits.stride(0), index=index.data_ptr(),
                      log_norm=log_norm.data_ptr(), num_threads=threads())
    if not all(map(math.isfinite, log_norm.tolist())):  # checked on the host: a few ops fewer per step
        # an infinite or NaN maximum (or an overflowing sum): torch's semantics for those rows
        rows = (~torch.isfinite(log_norm)).nonzero().squeeze(1)
        index[rows] = logits[rows].max(dim=-1).indices
        log_norm[rows] = torch.logsumexp(logits[rows], dim=-1)
    return index, log_norm
