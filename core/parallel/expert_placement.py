"""Where the routed experts of one MoE layer live under expert parallelism, and how a token's
choice of a logical expert becomes a physical slot.

A placement lists the physical expert slots of the EP group: slot `i` holds logical expert
`slots[i]`, and rank `r` holds the slots `r*S … (r+1)*S − 1` (S = slots per rank, the same on
every rank). Without load balancing there are exactly E slots and expert `e` sits in slot `e` (a
contiguous block per rank, `ExpertPlacement.contiguous`). With redundant experts (the eplb feature)
there are more slots than experts, and a hot expert has several slots holding the same weights.

Routing a token to a replica is a pure function of the token's index in its batch and the
sending rank (`(token + rank) mod replicas`), never of timing, so runs are reproducible; every
replica holds the same weights, so the choice changes where a row is computed, not its value.

`ExpertLoad` counts the rows each logical expert was sent, per MoE layer, and the rows each EP
rank served. The counts come from the header every MoE exchange already all-gathers, so they are
the whole group's and identical on every rank (a deterministic placement policy then computes the
same placement everywhere, with no extra communication).
"""
from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, model_validator


class ExpertPlacement(BaseModel):
    """Physical expert slots of one MoE layer over an EP group (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_experts: int  # logical (routed) experts of the layer
    ep_size: int
    slots: tuple[int, ...]  # slot -> logical expert; rank r holds slots [r*S, (r+1)*S)

    @model_validator(mode="after")
    def _check(self) -> ExpertPlacement:
        E, ep, n = self.num_experts, self.ep_size, len(self.slots)
        if E < 1 or ep < 1:
            raise ValueError(f"a placement needs at least one expert and one rank (got {E} experts, ep {ep})")
        if n < E or n % ep:
            raise ValueError(f"a placement of {E} experts over {ep} ranks needs a multiple of {ep} slots, at least "
                             f"{E}; got {n}")
        bad = sorted({e for e in self.slots if not 0 <= e < E})
        if bad:
            raise ValueError(f"a placement names experts {bad[:8]} outside 0..{E - 1}")
        missing = sorted(set(range(E)) - set(self.slots))
        if missing:
            raise ValueError(f"a placement leaves experts {missing[:8]} without a slot; every expert needs one")
        return self

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int) -> ExpertPlacement:
        """One slot per expert, expert e in slot e: the layout without load balancing."""
        return cls(num_experts=num_experts, ep_size=ep_size, slots=tuple(range(num_experts)))

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots) // self.ep_size

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        """The logical experts of `rank`'s slots, in slot order."""
        S = self.slots_per_rank
        return self.slots[rank * S:(rank + 1) * S]

    def replica_counts(self) -> list[int]:
        counts = [0] * self.num_experts
        for e in self.slots:
            counts[e] += 1
        return counts


class Router:
    """Logical expert ids -> physical slot ids for one placement (tables built once per placement)."""

    def __init__(self, placement: ExpertPlacement, rank: int, device: torch.device):
        self.identity = placement.slots == tuple(range(placement.num_experts))
        counts = placement.replica_counts()
        table = torch.zeros((placement.num_experts, max(counts)), dtype=torch.long)
        filled = [0] * placement.num_experts
        for slot, e in enumerate(placement.slots):  # replicas of e in slot order
            table[e, filled[e]] = slot
            filled[e] += 1
        self.table, self.count = table.to(device), torch.tensor(counts, dtype=torch.long, device=device)
        self.rank = rank

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` `[T, k]` logical experts -> `[T, k]` physical slots."""
        if self.identity:
            return ids
        token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1) + self.rank
        return self.table[ids, token % self.count[ids]]


class ExpertLoad:
    """Rows routed to each logical expert (per MoE layer) and rows served by each EP rank, summed
    over the whole group since counting started; the same on every rank. Cumulative (never reset:
    a reset on one rank only would make the ranks' counts differ); take differences of copies."""

    def __init__(self, ep_size: int) -> None:
        self.ep_size = ep_size
        self.expert_rows: dict[int, torch.Tensor] = {}  # layer key -> [E] int64
        self.rank_rows = torch.zeros(ep_size, dtype=torch.long)  # all layers together
        self.peak_rows = 0  # sum over exchanges of the busiest rank's rows: what the exchange waits for
        self.rounds = 0  # MoE exchanges counted

    def add(self, key: int, slot_rows: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
        """Count layer `key`'s part of one exchange: `slot_rows` `[num_slots]`, the rows every
        sender sent to each physical slot. Returns the rows per rank."""
        rows = self.expert_rows.get(key)
        if rows is None:
            rows = self.expert_rows[key] = torch.zeros(placement.num_experts, dtype=torch.long)
        rows.index_add_(0, torch.tensor(placement.slots), slot_rows)
        per_rank = slot_rows.reshape(self.ep_size, -1).sum(-1)
        self.rank_rows += per_rank
        return per_rank

    def end_round(self, rank_rows: torch.Tensor) -> None:
        """One exchange done, in which the ranks served `rank_rows` rows."""
        self.peak_rows += int(rank_rows.max())
        self.rounds += 1

    def imbalance(self) -> float:
        """max / mean of the rows each EP rank served in total (1.0: perfect balance; no rows: 1.0)."""
        return _ratio(self.rank_rows.max().item(), self.rank_rows.double().mean().item())

    def exchange_imbalance(self) -> float:
        """Per exchange, the busiest rank's rows over the mean, weighted by rows: the factor by
        which the slowest rank stretches the MoE exchanges compared with perfect balance."""
        return _ratio(self.peak_rows, self.rank_rows.double().sum().item() / self.ep_size)


def _ratio(top: float, mean: float) -> float:
    return top / mean if mean else 1.0
