"""Routed MoE with hash layers, clamped SwiGLU and a shared expert (sqrt-softplus router scores;
hash layers pick experts from the token id through `tid2eid`).

route -> dispatch -> grouped experts -> combine, all through the accelerator: with every expert
local as one `moe_sublayer` call (which a back end may fuse), under expert parallelism composed here
around the all-to-all. Router logits are computed in fp32 (as the official code does; identical to
transformers in fp32).
"""
from __future__ import annotations

import torch

from deepinfer.accelerator.interface import Accelerator, MoEDispatch, routing_scores, shared_expert
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.parallel.expert_parallel import current_expert_parallel


class MoE:
    def __init__(self, config: DeepseekV4Config, is_hash: bool, weights: dict[str, torch.Tensor],
                 accel: Accelerator):
        """`weights`: the block's tensors relative to `ffn.`, with the routed experts already fused
        into `experts.w13` `[E, 2I, D]` and `experts.w2` `[E, D, I]`."""
        self.c, self.accel, self.is_hash = config, accel, is_hash
        self.gate = weights["gate.weight"]
        self.bias = None if is_hash else weights["gate.bias"]
        self.tid2eid = weights["gate.tid2eid"] if is_hash else None
        self.w13, self.w2 = weights["experts.w13"], weights["experts.w2"]
        # expert parallelism: keep only this rank's experts (the EP group holds them, so a load
        # balancer can re-place them); the others are reached by all-to-all
        self.ep = current_expert_parallel()
        if self.ep is not None:
            shards = [self.ep.local_experts(self.w13), self.ep.local_experts(self.w2)]
            self.w13 = self.w2 = None
            self.ep_key = self.ep.register(self._local_experts, config.hidden_size, config.n_routed_experts, shards)
        self.shared = None
        if config.n_shared_experts:
            # w1 and w3 fused into one [2I, D] matrix at load (weights.FUSED_PROJECTIONS)
            self.shared = (weights["fused_shared.weight"], weights["shared_experts.w2.weight"])

    def _local_experts(self, rows: torch.Tensor, plan: MoEDispatch) -> torch.Tensor:
        """This rank's experts on the rows the EP exchange brought (the load balancer may re-place them)."""
        w13, w2 = self.ep.weights(self.ep_key)
        return self.accel.moe_experts(rows, plan, w13, w2, self.c.swiglu_limit)

    def run(self, x: torch.Tensor, step) -> torch.Tensor:
        """The block's sub-layer call (`block.StepInputs`): routing reads the step's token ids."""
        return self.forward(x, step.input_ids)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        a, c = self.accel, self.c
        hash_ids = self.tid2eid.index_select(0, input_ids) if self.is_hash else None  # rows: cheaper than indexing
        shared_w13, shared_w2 = (None, None) if self.shared is None else self.shared
        if self.ep is None:
            return a.moe_sublayer(x, self.gate, self.bias, hash_ids, self.w13, self.w2, shared_w13, shared_w2,
                                  c.num_experts_per_tok, c.routed_scaling_factor, c.scoring_func, c.swiglu_limit)
        scores = routing_scores(a.linear(x.float(), self.gate), c.scoring_func)
        weights, ids = a.moe_route(scores, self.bias, c.num_experts_per_tok, c.routed_scaling_factor, hash_ids)
        # logical experts -> physical slots (replicas under load balancing)
        rows, dispatch = a.moe_dispatch(x, self.ep.route(self.ep_key, ids), self.ep.num_slots(self.ep_key))
        y = a.moe_combine(self.ep.experts(self.ep_key, rows, dispatch), dispatch, weights)
        if self.shared is not None:
            y = y.add_(shared_expert(a, x, shared_w13, shared_w2, c.swiglu_limit))  # into the fresh fp32 sum
        return y.to(x.dtype)
