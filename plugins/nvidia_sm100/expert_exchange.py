"""Expert-parallel token exchange: send each token to the ranks that hold its experts, and back.

The accelerator interface has plain collectives (`all_to_all`) but no EP dispatch/combine kernel
yet; this module gives the NVIDIA back end one API with two implementations, chosen at
construction by `NvidiaAccelerator.expert_exchange`:

- `AllToAllExchange`: torch.distributed `all_to_all_single` (NCCL on GPU, gloo on CPU), any dtype;
- `DeepEPExchange` (deep_ep_exchange.py): DeepEP's `ElasticBuffer`, bf16, SM100 with NVLink/RDMA.

Both follow DeepEP's semantics, so the caller's code is the same for either:

    recv = exchange.dispatch(x, ids, weights)          # x [T, D], ids [T, k] global expert ids
    # recv.x [R, D]: every token that has at least one expert on this rank, once;
    # recv.ids [R, k]: this rank's *local* expert ids, -1 where the expert lives elsewhere;
    # recv.weights [R, k]: the routing weights, unchanged.
    y = ...  # [R, D]: sum over the token's local experts of weight * expert(x)
    out = exchange.combine(y, recv.handle)           # [T, D] fp32: the sum over all ranks
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Received:
    x: torch.Tensor  # [R, D] tokens received by this rank
    ids: torch.Tensor  # [R, k] int64 local expert ids, -1 = not on this rank
    weights: torch.Tensor  # [R, k] fp32 routing weights
    handle: Any  # what combine needs to send results back


@dataclass
class _Route:
    send_token: torch.Tensor  # [S] int64, the source token of every sent row, in send order
    input_splits: list[int]  # rows sent to each rank
    output_splits: list[int]  # rows received from each rank
    num_tokens: int


class AllToAllExchange:
    """EP dispatch/combine over torch.distributed uneven all-to-all."""

    name = "all_to_all"

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {self.world} expert-parallel "
                             f"ranks; choose an EP size that divides the number of experts")
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // self.world

    def _exchange(self, t: torch.Tensor, input_splits: list[int], output_splits: list[int]) -> torch.Tensor:
        out = t.new_empty((sum(output_splits), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=self.group)
        return out

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Received:
        owner = ids.long() // self.experts_per_rank  # [T, k] rank of every chosen expert
        ranks = torch.arange(self.world, device=ids.device)
        goes_to = (owner.unsqueeze(-1) == ranks).any(dim=1)  # [T, world]: a token goes once per rank
        dest_rank, send_token = goes_to.t().nonzero(as_tuple=True)  # ordered by rank, then token
        input_splits = torch.bincount(dest_rank, minlength=self.world)
        output_splits = torch.empty_like(input_splits)
        dist.all_to_all_single(output_splits, input_splits, group=self.group)
        route = _Route(send_token, input_splits.tolist(), output_splits.tolist(), x.shape[0])
        local = ids.long()[send_token] - (dest_rank * self.experts_per_rank).unsqueeze(-1)
        on_dest = (local >= 0) & (local < self.experts_per_rank)
        send_ids = torch.where(on_dest, local, torch.full_like(local, -1))
        return Received(
            x=self._exchange(x[send_token], route.input_splits, route.output_splits),
            ids=self._exchange(send_ids, route.input_splits, route.output_splits),
            weights=self._exchange(weights.float()[send_token], route.input_splits, route.output_splits),
            handle=route)

    def combine(self, y: torch.Tensor, handle: _Route) -> torch.Tensor:
        back = self._exchange(y, handle.output_splits, handle.input_splits)  # [S, D] in send order
        out = torch.zeros((handle.num_tokens, y.shape[-1]), dtype=torch.float32, device=y.device)
        return out.index_add_(0, handle.send_token, back.float())
