"""Expert parallelism: each rank of the EP group holds `E / ep` routed experts and serves the
(token, expert) rows every rank routes to them, exchanged by uneven all-to-all through the back
end's `Collectives`. Shared experts, attention and dense layers stay replicated.

Placement: expert e lives on rank e // (E / ep) (`ExpertParallel.owner`), a contiguous block
per rank, so the rows `moe_dispatch` already groups by expert are also grouped by destination.

One MoE call (`ExpertParallel.experts`), on every rank of the group:
  1. all_gather a header [status, layer key, dtype code, rows per global expert]: every rank
     learns the whole count matrix (source rank x expert);
  2. all_to_all the rows out (uneven), regroup them by local expert, run `moe_experts` on the
     local shard, all_to_all the results back in the sender's order; the sender's own
     `moe_combine` then weights and sums them exactly as on one device.

Lockstep (data-parallel attention): DP ranks step their own request streams, so one can run out
of work while another is mid-forward. A rank with nothing to run calls `idle_until_peers_done()`,
which joins MoE calls with status 0 and no rows, serving whatever layer the active ranks name in
their header, until a header round shows every rank idle; then all leave that round together.
Active ranks need not be in the same layer (one may be drafting with the MTP block while another
verifies): each sender's rows are served with the layer its header names (the key: the MoE
layer's construction index, the same on every rank). Every rank just makes its own MoE calls in
order; call i of one rank meets call i of every other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.accelerator.interface import Accelerator, Collectives, MoEDispatch
from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.parallel.layout import ParallelConfigError, ParallelLayout

#: dtypes a header can name (its index): the rows' dtype an idle rank must match.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEAD = 3  # status, layer key, dtype code

ExpertFn = Callable[[torch.Tensor, MoEDispatch], torch.Tensor]


@dataclass
class _Layer:
    run: ExpertFn  # moe_experts over this rank's shard
    hidden: int
    num_experts: int  # global


class ExpertParallel:
    """This rank's view of the EP group (the whole world in this release)."""

    def __init__(self, collectives: Collectives, rank: int, size: int, device: torch.device):
        if not 0 <= rank < size:
            raise ValueError(f"EP rank {rank} is outside an EP group of {size}")
        self.collectives, self.rank, self.size, self.device = collectives, rank, size, device
        self._layers: list[_Layer] = []

    # ----- placement -----
    def shard(self, num_experts: int) -> range:
        """The global expert ids this rank holds."""
        if num_experts % self.size:
            raise ParallelConfigError(f"the model has {num_experts} routed experts, which do not split evenly over "
                                      f"--ep {self.size}; choose an ep that divides {num_experts}")
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def owner(self, expert: int, num_experts: int) -> int:
        return expert // (num_experts // self.size)

    def local_experts(self, stacked: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        """This rank's slice `[E/ep, ...]` of a stacked expert weight `[E, ...]` (a copy, so the
        full tensor can be freed)."""
        ids = self.shard(stacked.shape[0])
        if isinstance(stacked, QuantizedWeight):
            return QuantizedWeight(stacked.data[ids.start:ids.stop].clone(), stacked.scale[ids.start:ids.stop].clone(),
                                   stacked.block, stacked.dtype)
        return stacked[ids.start:ids.stop].clone()

    def register(self, run: ExpertFn, hidden: int, num_experts: int) -> int:
        """Record a MoE layer (in construction order, the same on every rank); returns its key."""
        self.shard(num_experts)
        self._layers.append(_Layer(run, hidden, num_experts))
        return len(self._layers) - 1

    # ----- one MoE call -----
    def experts(self, key: int, rows: torch.Tensor, plan: MoEDispatch) -> torch.Tensor:
        """The expert outputs of `rows` (grouped by global expert, as `moe_dispatch` returns them),
        computed wherever each expert lives; same order and shape as `rows`."""
        out = self._round(1, key, rows, plan.tokens_per_expert)
        if out is None:  # cannot happen: this rank is active, so the round is not an all-idle one
            raise RuntimeError("an expert-parallel round with an active rank reported every rank idle")
        return out

    def idle_until_peers_done(self) -> None:
        """Join MoE calls with no rows until every rank of the group is idle (see module docstring)."""
        while self._round(0, 0, None, None) is not None:
            pass

    def _round(self, status: int, key: int, rows: torch.Tensor | None,
               counts: torch.Tensor | None) -> torch.Tensor | None:
        width = max((layer.num_experts for layer in self._layers), default=0)
        header = torch.zeros((1, _HEAD + width), dtype=torch.long, device=self.device)
        if status:
            header[0, 0], header[0, 1], header[0, 2] = 1, key, _DTYPES.index(rows.dtype)
            header[0, _HEAD:_HEAD + counts.numel()] = counts.to(self.device)
        table = self.collectives.all_gather(header).cpu()
        active = table[:, 0].nonzero().flatten().tolist()
        if not active:
            return None  # every rank is idle: the lockstep ends here, for all of them at once
        dtypes = {int(table[r, 2]) for r in active}
        if len(dtypes) != 1:
            raise RuntimeError(f"expert-parallel ranks send rows in different dtypes "
                               f"{sorted(str(_DTYPES[d]) for d in dtypes)}; every rank must run the same model dtype")
        layers = {int(table[r, 1]) for r in active}
        num_experts = {self._layers[k].num_experts for k in layers}
        if len(num_experts) != 1:
            raise RuntimeError(f"expert-parallel ranks are in MoE layers {sorted(layers)} with different expert "
                               f"counts {sorted(num_experts)}; the header cannot describe one exchange")
        E = num_experts.pop()
        per = E // self.size
        matrix = table[:, _HEAD:_HEAD + E].reshape(self.size, self.size, per)  # [src, dst, local]
        send = matrix[self.rank].sum(-1).tolist()
        recv = matrix[:, self.rank].sum(-1).tolist()
        if rows is None:
            rows = torch.empty((0, self._layers[min(layers)].hidden), dtype=_DTYPES[dtypes.pop()], device=self.device)
        got = self.collectives.all_to_all(rows, send, recv)
        back = torch.empty_like(got)
        mine = matrix[:, self.rank]  # [src, local expert]: the rows this rank serves
        # ranks step independently, so two senders may be in different layers: serve each
        # sender's rows with the layer its header names
        for key in sorted(layers):
            senders = torch.tensor([int(table[s, 0]) == 1 and int(table[s, 1]) == key for s in range(self.size)])
            blocks = mine * senders.unsqueeze(1)
            if not int(blocks.sum()):
                continue
            order = _group_by_expert(mine, senders).to(got.device)
            local = MoEDispatch(tokens_per_expert=blocks.sum(0).to(got.device),
                                source_token=torch.arange(order.numel(), device=got.device),
                                source_slot=torch.zeros(order.numel(), dtype=torch.long, device=got.device),
                                num_tokens=order.numel())
            back[order] = self._layers[key].run(got.index_select(0, order), local)  # rows go home in arrival order
        return self.collectives.all_to_all(back, recv, send)


def _group_by_expert(blocks: torch.Tensor, senders: torch.Tensor) -> torch.Tensor:
    """Received rows come source by source, each source's rows by local expert (`blocks[s, e]`
    rows each); the positions of the `senders`' rows listed expert by expert instead."""
    flat = blocks.flatten()
    starts = (torch.cumsum(flat, 0) - flat).reshape(blocks.shape)
    parts = [torch.arange(int(starts[s, e]), int(starts[s, e] + blocks[s, e]))
             for e in range(blocks.shape[1]) for s in range(blocks.shape[0]) if senders[s] and blocks[s, e]]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


_CURRENT: ExpertParallel | None = None
_LAYOUT: ParallelLayout | None = None


def current_expert_parallel() -> ExpertParallel | None:
    """The EP group this process's MoE layers shard over, or None (all experts local)."""
    return _CURRENT


def current_layout() -> ParallelLayout | None:
    """The layout this process was launched in, or None outside a multi-process launch."""
    return _LAYOUT


def set_expert_parallel(ep: ExpertParallel | None, layout: ParallelLayout | None = None) -> None:
    global _CURRENT, _LAYOUT
    _CURRENT, _LAYOUT = ep, layout


def join_world(accelerator: Accelerator, rank: int, layout: ParallelLayout, init_method: str) -> None:
    """In a rank's process: join the process group through the back end and, with ep > 1,
    install the EP group the MoE layers will find when the model is built."""
    if accelerator.capabilities().collectives == "none":
        raise ParallelConfigError(f"the {accelerator.name} back end declares no collectives, so it cannot run "
                                  f"{layout.describe()}; use --ep 1 --dp 1 --cp 1")
    accelerator.init_process_group(rank, layout.world_size, init_method)
    ep = ExpertParallel(accelerator, rank % layout.ep, layout.ep, accelerator.device(0)) if layout.ep > 1 else None
    set_expert_parallel(ep, layout)


def idle_until_peers_done() -> None:
    """Call after this rank's own work (e.g. after `LLM.generate`): no-op without expert parallelism."""
    if _CURRENT is not None:
        _CURRENT.idle_until_peers_done()
