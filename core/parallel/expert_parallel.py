"""Expert parallelism: each rank of the EP group holds `E / ep` routed experts and serves the
(token, expert) rows every rank routes to them, exchanged by uneven all-to-all through the back
end's `Collectives`. Shared experts, attention and dense layers stay replicated.

Groups: a launch has `dp x cp / ep` EP groups (`ParallelLayout.ep_groups`); every rank below is a
rank within its group, and every collective goes over the group's own process group
(`groups.GroupCollectives`). Each group exchanges, steps its lockstep, counts its load and places
its experts on its own; nothing crosses groups.

Placement: each MoE layer has an `ExpertPlacement` (expert_placement.py): physical slots, S per
rank, rank r holding slots r*S … (r+1)*S − 1. By default there is one slot per expert and expert
e lives on rank e // (E / ep), a contiguous block per rank. The MoE layer maps its logical top-k ids
to slots (`route`) before `moe_dispatch`, so the rows come grouped by slot and so by destination.
A load balancer (the eplb feature) installs placements with more slots than experts (replicas of
the hot ones) and re-places them while the engine runs (`set_rebalancer`, `install`).

One MoE call (`ExpertParallel.experts`), on every rank of the group:
  1. all_gather a header [status, layer key, dtype code, rows per global expert]: every rank
     learns the whole count matrix (source rank x expert);
  2. all_to_all the rows out (uneven), regroup them by local expert, run `moe_experts` on the
     local shard, all_to_all the results back in the sender's order; the sender's own
     `moe_combine` then weights and sums them exactly as on one device.

Lockstep (data-parallel attention): DP ranks step their own request streams, so one can run out
of work while another is mid-forward (with cp > 1 a DP rank is a CP group whose ranks step
together; an EP group of several CP groups runs this lockstep between them). A rank with nothing
to run calls `idle_until_peers_done()`, which joins MoE calls with status 0 and no rows, serving
whatever layer the active ranks name in their header, until a header round shows every rank idle;
then all leave that round together.
Active ranks need not be in the same layer (one may be drafting with the MTP block while another
verifies): each sender's rows are served with the layer its header names (the key: the MoE
layer's construction index, the same on every rank). Every rank just makes its own MoE calls in
order; call i of one rank meets call i of every other.

Re-placement happens between two exchanges, at the same exchange count on every rank (the count
of non-idle header rounds, which every rank sees alike): right after round n·interval all ranks
compute the new placements from the same load counts and move the expert weights by all-to-all.
A rank mid-forward simply routes its next MoE layer with the new placement; no request waits
longer than that one move.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.accelerator.interface import Accelerator, Collectives, MoEDispatch
from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.parallel.context_parallel import ContextParallel, set_context_parallel
from deepinfer.parallel.expert_placement import ExpertLoad, ExpertPlacement, Router
from deepinfer.parallel.groups import GroupCollectives, check_subgroups, make_groups
from deepinfer.parallel.layout import ParallelConfigError, ParallelLayout

#: dtypes a header can name (its index): the rows' dtype an idle rank must match.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEAD = 3  # status, layer key, dtype code

ExpertFn = Callable[[torch.Tensor, MoEDispatch], torch.Tensor]
Weight = torch.Tensor | QuantizedWeight
#: layer key -> the placement it should have next (from the load counts); see `set_rebalancer`
Rebalancer = Callable[[ExpertLoad], dict[int, ExpertPlacement]]


@dataclass
class _Layer:
    run: ExpertFn  # moe_experts over this rank's slots
    hidden: int
    num_experts: int  # logical (routed) experts
    weights: list[Weight] | None  # this rank's stacked expert weights, one slot per row; None: fixed placement
    placement: ExpertPlacement
    router: Router


class ExpertParallel:
    """This rank's view of its EP group: `collectives` are the group's (a `GroupCollectives`, or a
    back end's own when the group is the whole world), `rank` and `size` its place in the group;
    `prepare_weights`: the back end's (`SmallOps.prepare_weights`), given the expert weights a re-placement
    brings (`install`), as the model gives its own at load."""

    def __init__(self, collectives: Collectives | GroupCollectives, rank: int, size: int, device: torch.device,
                 prepare_weights: Callable[[Iterable[tuple[str, Weight]]], None] | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"EP rank {rank} is outside an EP group of {size}")
        self.collectives, self.rank, self.size, self.device = collectives, rank, size, device
        self.prepare_weights = prepare_weights
        self._layers: list[_Layer] = []
        self.load: ExpertLoad | None = None  # counted only once `track_load` is called
        self._rounds = 0  # non-idle exchanges, the same count on every rank
        self._rebalancer: Rebalancer | None = None
        self._interval = 0

    # ----- placement -----
    def shard(self, num_experts: int) -> range:
        """The global expert ids this rank holds under the contiguous placement (at registration)."""
        if num_experts % self.size:
            raise ParallelConfigError(f"the model has {num_experts} routed experts, which do not split evenly over "
                                      f"--ep {self.size}; choose an ep that divides {num_experts}")
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def local_experts(self, stacked: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        """This rank's slice `[E/ep, ...]` of a stacked expert weight `[E, ...]` (a copy, so the
        full tensor can be freed)."""
        ids = self.shard(stacked.shape[0])
        if isinstance(stacked, QuantizedWeight):
            return QuantizedWeight(stacked.data[ids.start:ids.stop].clone(), stacked.scale[ids.start:ids.stop].clone(),
                                   stacked.block, stacked.dtype)
        return stacked[ids.start:ids.stop].clone()

    def register(self, run: ExpertFn, hidden: int, num_experts: int, weights: list[Weight] | None = None) -> int:
        """Record a MoE layer (in construction order, the same on every rank); returns its key.
        `weights`: this rank's contiguous shards (`local_experts`) of the layer's stacked expert
        weights, which `run` reads back through `weights(key)`; a layer registered without them
        keeps the contiguous placement for good."""
        self.shard(num_experts)
        placement = ExpertPlacement.contiguous(num_experts, self.size)
        self._layers.append(_Layer(run, hidden, num_experts, weights, placement,
                                   Router(placement, self.rank, self.device)))
        return len(self._layers) - 1

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def weights(self, key: int) -> list[Weight]:
        """This rank's expert weights of layer `key`, one row per slot it holds (replaced by `install`)."""
        return self._layers[key].weights

    def placement(self, key: int) -> ExpertPlacement:
        return self._layers[key].placement

    def num_slots(self, key: int) -> int:
        return self._layers[key].placement.num_slots

    def route(self, key: int, ids: torch.Tensor) -> torch.Tensor:
        """Top-k logical expert ids `[T, k]` -> the physical slots their rows go to."""
        return self._layers[key].router(ids)

    # ----- load counts and re-placement -----
    def track_load(self) -> ExpertLoad:
        """Start counting rows per expert and per rank in every exchange (cheap: the counts are
        in the header every rank already has)."""
        if self.load is None:
            self.load = ExpertLoad(self.size)
        return self.load

    def set_rebalancer(self, rebalancer: Rebalancer | None, interval: int) -> None:
        """Every `interval` exchanges, ask `rebalancer` for new placements and `install` them.
        Must be set identically on every rank (the feature does it at engine start)."""
        if rebalancer is not None and interval < 1:
            raise ValueError(f"a rebalancing interval must be >= 1 exchange, got {interval}")
        self.track_load()
        self._rebalancer, self._interval = rebalancer, interval

    def install(self, key: int, placement: ExpertPlacement) -> int:
        """Collective (every rank, same arguments): give layer `key` a new placement, moving the
        expert weights each rank's new slots need from a rank that holds them (itself if it can)
        by one all-to-all per weight tensor. Returns the number of slot weights this rank received."""
        layer = self._layers[key]
        if layer.weights is None:
            raise RuntimeError(f"MoE layer {key} was registered without its weights, so it cannot be re-placed")
        if (placement.num_experts, placement.ep_size) != (layer.num_experts, self.size):
            raise ValueError(f"a placement of {placement.num_experts} experts over {placement.ep_size} ranks does "
                             f"not fit MoE layer {key} ({layer.num_experts} experts, ep {self.size})")
        self._check_same_everywhere(key, placement)
        old, S = layer.placement, placement.slots_per_rank
        holders: dict[int, list[tuple[int, int]]] = {}  # expert -> [(rank, its local slot)] in the old placement
        for slot, e in enumerate(old.slots):
            holders.setdefault(e, []).append(divmod(slot, old.slots_per_rank))
        # every new slot's source: the destination itself when it already holds the expert, else
        # the lowest rank that does
        sources = []
        for slot, e in enumerate(placement.slots):
            dst = slot // S
            sources.append(next(((r, i) for r, i in holders[e] if r == dst), holders[e][0]))
        send = [[i for slot, (r, i) in enumerate(sources) if r == self.rank and slot // S == d] for d in range(self.size)]
        recv = [[slot % S for slot, (r, _) in enumerate(sources) if r == s and slot // S == self.rank]
                for s in range(self.size)]
        local = [(slot % S, i) for slot, (r, i) in enumerate(sources) if r == self.rank and slot // S == self.rank]
        send[self.rank], recv[self.rank] = [], []
        layer.weights = [_move(w, send, recv, local, S, self.collectives) for w in layer.weights]
        if self.prepare_weights is not None:
            self.prepare_weights([("moe_experts", w) for w in layer.weights])
        layer.placement, layer.router = placement, Router(placement, self.rank, self.device)
        return sum(map(len, recv))

    def _check_same_everywhere(self, key: int, placement: ExpertPlacement) -> None:
        """A placement policy must be deterministic: every rank has to install the same one."""
        mine = torch.tensor([placement.num_slots, *placement.slots], dtype=torch.long, device=self.device)
        sizes = self.collectives.all_gather(mine[:1].clone()).cpu()
        if int(sizes.min()) != int(sizes.max()):
            raise RuntimeError(f"EP ranks computed placements of different sizes {sizes.tolist()} for MoE layer "
                               f"{key}; a placement policy must give the same result on every rank")
        table = self.collectives.all_gather(mine.unsqueeze(0)).cpu()
        if not bool((table == table[:1]).all()):
            raise RuntimeError(f"EP ranks computed different placements for MoE layer {key}; a placement policy "
                               f"must be deterministic (the same load counts give the same placement everywhere)")

    def _after_round(self) -> None:
        self._rounds += 1
        if self._rebalancer is None or self._rounds % self._interval:
            return
        for key, placement in sorted(self._rebalancer(self.load).items()):
            if placement != self._layers[key].placement:  # the same decision on every rank
                self.install(key, placement)

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
        width = max((layer.placement.num_slots for layer in self._layers), default=0)
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
        num_slots = {self._layers[k].placement.num_slots for k in layers}
        if len(num_slots) != 1:
            raise RuntimeError(f"expert-parallel ranks are in MoE layers {sorted(layers)} with different expert "
                               f"slot counts {sorted(num_slots)}; the header cannot describe one exchange")
        P = num_slots.pop()
        per = P // self.size
        if self.load is not None:
            served = torch.zeros(self.size, dtype=torch.long)
            for key in layers:
                senders = (table[:, 0] == 1) & (table[:, 1] == key)
                served += self.load.add(key, table[senders, _HEAD:_HEAD + P].sum(0), self._layers[key].placement)
            self.load.end_round(served)
        matrix = table[:, _HEAD:_HEAD + P].reshape(self.size, self.size, per)  # [src, dst, local]
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
        out = self.collectives.all_to_all(back, recv, send)
        self._after_round()  # the caller's rows are home: a re-placement now affects only later calls
        return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`[n, ...]` -> `[n, bytes]` uint8 view: every dtype (bf16, FP8, scales) moves through one
    collective dtype that every back end's all-to-all supports."""
    t = t.contiguous()
    return t.reshape(t.shape[0], -1).view(torch.uint8) if t.dim() > 1 else t.reshape(-1, 1).view(torch.uint8)


def _move(w: Weight, send: list[list[int]], recv: list[list[int]], local: list[tuple[int, int]], slots: int,
          collectives: Collectives | GroupCollectives) -> Weight:
    """The stacked weight of this rank's new `slots`: kept rows (`local`: new slot <- old row) plus
    rows sent rank to rank (`send[d]`: old rows for rank d; `recv[s]`: new slots filled from rank s)."""
    if isinstance(w, QuantizedWeight):
        return QuantizedWeight(_move(w.data, send, recv, local, slots, collectives),
                               _move(w.scale, send, recv, local, slots, collectives), w.block, w.dtype)
    raw = _as_bytes(w)
    order = [i for rows in send for i in rows]
    outgoing = raw.index_select(0, torch.tensor(order, dtype=torch.long, device=raw.device))
    incoming = collectives.all_to_all(outgoing, [len(r) for r in send], [len(r) for r in recv])
    new = torch.empty((slots, raw.shape[1]), dtype=torch.uint8, device=raw.device)
    for new_slot, old_row in local:
        new[new_slot] = raw[old_row]
    targets = [slot for rows in recv for slot in rows]
    if targets:
        new[torch.tensor(targets, dtype=torch.long, device=raw.device)] = incoming
    return new.view(w.dtype).reshape(slots, *w.shape[1:])


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
    """In a rank's process: join the process group through the back end, make the EP and CP
    groups (`groups.make_groups`) and install this rank's EP group (ep > 1) and CP group (cp > 1)
    the model will find when it is built."""
    if accelerator.capabilities().collectives == "none":
        raise ParallelConfigError(f"the {accelerator.name} back end declares no collectives, so it cannot run "
                                  f"{layout.describe()}; use --ep 1 --dp 1 --cp 1")
    check_subgroups(layout, type(accelerator), accelerator.name)
    accelerator.init_process_group(rank, layout.world_size, init_method)
    groups = make_groups(accelerator, layout, rank)
    device = accelerator.device(0)
    ep = ExpertParallel(groups.ep, groups.ep.rank, groups.ep.size, device, accelerator.prepare_weights) \
        if groups.ep else None
    set_expert_parallel(ep, layout)
    set_context_parallel(ContextParallel(groups.cp, groups.cp.rank, groups.cp.size, device) if groups.cp else None)


def idle_until_peers_done() -> None:
    """Call after this rank's own work (e.g. after `LLM.generate`): no-op without expert parallelism."""
    if _CURRENT is not None:
        _CURRENT.idle_until_peers_done()
