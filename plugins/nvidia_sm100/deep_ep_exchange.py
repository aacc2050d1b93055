"""Expert-parallel exchange through DeepEP (deepseek-ai/DeepEP V2, `deep_ep.ElasticBuffer`).

Same API and semantics as `expert_exchange.AllToAllExchange` (see there): DeepEP's non-expanded
dispatch delivers each token once per destination rank with *local* expert ids (-1 elsewhere)
and its top-k weights; its combine sums the per-rank partial results back onto the source rank.
DeepEP moves bf16 rows only; the accelerator picks this class for bf16 activations on SM100.

`deep_ep` is imported in `DeepEPExchange.__init__` only (importing it initialises NCCL/JIT state).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_plugins.nvidia_sm100.expert_exchange import Received


@dataclass
class _DeepEPHandle:
    handle: Any  # deep_ep.EPHandle
    recv_rows: int  # rows of DeepEP's receive buffer (combine wants the same row count)
    num_received: int  # rows that hold real tokens


class DeepEPExchange:
    name = "deep_ep"

    def __init__(self, num_experts: int, hidden: int, top_k: int, max_tokens_per_rank: int,
                 group: dist.ProcessGroup | None = None) -> None:
        import deep_ep  # noqa: PLC0415 - optional library, imported only when this path is selected

        self.group = group if group is not None else dist.group.WORLD
        self.num_experts = num_experts
        self.max_tokens_per_rank = max_tokens_per_rank
        self._topk_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        self.buffer = deep_ep.ElasticBuffer(self.group, num_max_tokens_per_rank=max_tokens_per_rank,
                                            hidden=hidden, num_topk=top_k)

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Received:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"DeepEP dispatches bf16 activations, got {x.dtype}; use the all_to_all exchange")
        if x.shape[0] > self.max_tokens_per_rank:
            raise ValueError(f"{x.shape[0]} tokens exceed the DeepEP buffer's max_tokens_per_rank="
                             f"{self.max_tokens_per_rank}; create the exchange with a larger bound")
        recv_x, recv_ids, recv_w, handle, _event = self.buffer.dispatch(
            x, topk_idx=ids.to(self._topk_dtype), topk_weights=weights.float(), num_experts=self.num_experts,
            num_max_tokens_per_rank=self.max_tokens_per_rank, do_cpu_sync=True)
        n = int(handle.num_recv_tokens)  # exact because do_cpu_sync=True
        return Received(x=recv_x[:n], ids=recv_ids[:n].long(), weights=recv_w[:n],
                        handle=_DeepEPHandle(handle, recv_x.shape[0], n))

    def combine(self, y: torch.Tensor, handle: _DeepEPHandle) -> torch.Tensor:
        full = y.new_zeros((handle.recv_rows, y.shape[-1]), dtype=torch.bfloat16)
        full[:handle.num_received] = y
        combined, _weights, _event = self.buffer.combine(full, handle=handle.handle)
        return combined.float()
