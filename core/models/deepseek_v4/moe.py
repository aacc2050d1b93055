"""Routed MoE with hash layers, clamped SwiGLU and a shared expert (sqrt-softplus router scores;
hash layers pick experts from the token id through `tid2eid`).

route -> dispatch -> grouped experts -> combine, all through the accelerator: with every expert
local as one `moe_sublayer` call (which a back end may fuse), under expert parallelism composed here
around the all-to-all. Router logits are computed in fp32 (as the official code does; identical to
transformers in fp32).

Expert parallelism inside a context-parallel group: a step the CP group does not split (decode,
verification, drafting, short chunks) holds the same rows on every rank of the group, which must
end it with bitwise-identical state. Sent to the experts from every rank, a row's copies would be
computed in different expert batches (another replica under EPLB, another row count and position
in the expert's GEMM), and an expert product's bits depend on those on the CPU back end (kernel and
tile choices by row count), so the ranks would drift apart. Instead each rank sends only its
zig-zag share of the rows and the group all-gathers the outputs: every row is computed once, and
every rank holds the same bits (`_shared_over_cp`).
"""
from __future__ import annotations

import torch

from deepinfer.accelerator.interface import Accelerator, MoEDispatch, routing_scores, shared_expert
from deepinfer.models.common.weights import WeightUses
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.program import Builder, Ref
from deepinfer.parallel.context_parallel import RowSplit, current_context_parallel
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
        # the CP group whose ranks share the rows of the steps it does not split (module doc)
        self.cp = current_context_parallel() if self.ep is not None else None
        self.shared = None
        if config.n_shared_experts:
            # w1 and w3 fused into one [2I, D] matrix at load (weights.FUSED_PROJECTIONS)
            self.shared = (weights["fused_shared.weight"], weights["shared_experts.w2.weight"])

    def weight_uses(self) -> WeightUses:
        """The router's and the experts' tensors, by the op that reads them (`SmallOps.prepare_weights`)."""
        yield "linear", self.gate
        experts = (self.w13, self.w2) if self.ep is None else self.ep.weights(self.ep_key)
        for w in experts:
            yield "moe_experts", w
        for w in self.shared or ():
            yield "linear", w

    def _local_experts(self, rows: torch.Tensor, plan: MoEDispatch) -> torch.Tensor:
        """This rank's experts on the rows the EP exchange brought (the load balancer may re-place them)."""
        w13, w2 = self.ep.weights(self.ep_key)
        return self.accel.moe_experts(rows, plan, w13, w2, self.c.swiglu_limit)

    def run(self, x: torch.Tensor, step) -> torch.Tensor:
        """The block's sub-layer call (`block.StepInputs`): routing reads the step's token ids."""
        return self.forward(x, step.input_ids, step.cp_split)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, cp_split: RowSplit | None = None) -> torch.Tensor:
        """x `[T, D]` -> `[T, D]`. `cp_split`: the context-parallel split whose rows of this rank `x`
        holds, or None when `x` is the whole step (on every rank of a CP group alike)."""
        if self.ep is not None:
            if self.cp is not None and cp_split is None:
                return self._shared_over_cp(x, input_ids)
            return self._exchange(x, input_ids)
        a, c = self.accel, self.c
        shared_w13, shared_w2 = (None, None) if self.shared is None else self.shared
        return a.moe_sublayer(x, self.gate, self.bias, self.hash_ids(input_ids), self.w13, self.w2, shared_w13,
                              shared_w2, c.num_experts_per_tok, c.routed_scaling_factor, c.scoring_func,
                              c.swiglu_limit)

    def hash_ids(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """A hash layer's experts of each row (rows of `tid2eid`: cheaper than indexing), else None."""
        return self.tid2eid.index_select(0, input_ids) if self.is_hash else None

    def lower_decode(self, b: Builder, x: Ref, step: Ref) -> Ref:
        """`run` on a step not split over a context-parallel group, as program calls: the whole layer in one
        `moe_sublayer` call when every expert is local, else `forward` (the expert-parallel exchange) as one."""
        input_ids = b.input("input_ids", lambda s: s.input_ids)
        if self.ep is not None:
            return b.call(self.forward, x=x, input_ids=input_ids)
        c = self.c
        shared_w13, shared_w2 = (None, None) if self.shared is None else self.shared
        hash_ids = b.call(self.hash_ids, input_ids=input_ids) if self.is_hash else None
        return b.call("kernels.moe_sublayer", x=x, gate=self.gate, gate_bias=self.bias, hash_ids=hash_ids, w13=self.w13,
                      w2=self.w2, shared_w13=shared_w13, shared_w2=shared_w2, top_k=c.num_experts_per_tok,
                      routed_scaling_factor=c.routed_scaling_factor, scoring_func=c.scoring_func,
                      swiglu_limit=c.swiglu_limit)

    def _shared_over_cp(self, x: torch.Tensor, input_ids: torch.Tensor, chosen: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """Rows every rank of the CP group holds: each rank runs its zig-zag share of them through the
        EP exchange, then the group all-gathers the outputs (module doc). `chosen` as for `_exchange`."""
        share = self.cp.split([x.shape[0]], x.device)
        rows = share.local_rows
        mine = None if chosen is None else chosen.index_select(0, rows)
        return share.gather(self._exchange(x.index_select(0, rows), input_ids.index_select(0, rows), mine))

    def _exchange(self, x: torch.Tensor, input_ids: torch.Tensor, chosen: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """This rank's rows: routing, the EP all-to-all to the experts' ranks and back, the combine.
        `chosen`: experts `[T, top_k]` selected already (a subclass's own rule; hash layers: None)."""
        a, c = self.accel, self.c
        scores = routing_scores(a.linear(x.float(), self.gate), c.scoring_func)
        weights, ids = a.moe_route(scores, self.bias, c.num_experts_per_tok, c.routed_scaling_factor,
                                   self.hash_ids(input_ids) if chosen is None else chosen)
        # logical experts -> physical slots (replicas under load balancing)
        rows, dispatch = a.moe_dispatch(x, self.ep.route(self.ep_key, ids), self.ep.num_slots(self.ep_key))
        y = a.moe_combine(self.ep.experts(self.ep_key, rows, dispatch), dispatch, weights)
        if self.shared is not None:
            y = y.add_(shared_expert(a, x, *self.shared, c.swiglu_limit))  # into the fresh fp32 sum
        return y.to(x.dtype)
