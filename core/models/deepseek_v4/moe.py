"""Routed MoE with hash layers, clamped SwiGLU and a shared expert (sqrt-softplus router scores;
hash layers pick experts from the token id through `tid2eid`).

route -> dispatch -> grouped experts -> combine, all through the accelerator. Router logits are
computed in fp32 (as the official code does; identical to transformers in fp32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.accelerator.interface import Accelerator, MoEDispatch
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.parallel.expert_parallel import current_expert_parallel


def routing_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


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
        w13, w2 = self.ep.weights(self.ep_key) if self.ep is not None else (self.w13, self.w2)
        return self.accel.moe_experts(rows, plan, w13, w2, self.c.swiglu_limit)

    def run(self, x: torch.Tensor, step) -> torch.Tensor:
        """The block's sub-layer call (`block.StepInputs`): routing reads the step's token ids."""
        return self.forward(x, step.input_ids)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        a, c = self.accel, self.c
        scores = routing_scores(a.linear(x.float(), self.gate), c.scoring_func)
        hash_ids = self.tid2eid[input_ids] if self.is_hash else None
        weights, ids = a.moe_route(scores, self.bias, c.num_experts_per_tok, c.routed_scaling_factor, hash_ids)
        if self.ep is not None:  # logical experts -> physical slots (replicas under load balancing)
            rows, dispatch = a.moe_dispatch(x, self.ep.route(self.ep_key, ids), self.ep.num_slots(self.ep_key))
            out = self.ep.experts(self.ep_key, rows, dispatch)
        else:
            rows, dispatch = a.moe_dispatch(x, ids, c.n_routed_experts)
            out = self._local_experts(rows, dispatch)
        y = a.moe_combine(out, dispatch, weights)
        if self.shared is not None:
            w13, w2 = self.shared
            gate_up = a.linear(x, w13)
            inter = w2.shape[1]
            h = a.swiglu(gate_up[..., :inter], gate_up[..., inter:], c.swiglu_limit)
            y = y.add_(a.linear(h, w2))  # into the combine's fresh fp32 result
        return y.to(x.dtype)
