"""The default placement policy: redundant-slot rounding and greedy bin-packing of hot experts.

`physical_slots` is the rounding rule for the redundant experts. `greedy_placement` first gives
the spare slots to the experts with the highest load per replica (one at a time, a heap), then
packs the replicas, heaviest first, each onto the least loaded rank that still has a free slot
(preferring a rank that does not hold that expert yet). Ties break by expert id and rank, so the
same counts give the same placement on every rank.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

from deepinfer.parallel.expert_placement import ExpertPlacement

from .config import EXTRA_VAR


def physical_slots(num_experts: int, extra: int, ep_size: int) -> int:
    """Expert slots of the EP group: at least `num_experts + extra`, rounded up to a multiple of
    `ep_size` so every rank holds the same number."""
    for name, value, low in (("num_experts", num_experts, 1), ("ep_size", ep_size, 1), ("extra", extra, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            hint = f"; set {EXTRA_VAR} to 0 or a positive integer" if name == "extra" else ""
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}{hint}")
    return -(-(num_experts + extra) // ep_size) * ep_size


def replica_counts(load: Sequence[float], num_slots: int, cap: int | None = None) -> list[int]:
    """Slots per expert: one each, then every spare slot to the expert with the most load per
    replica, at most `cap` each while any expert is below it (a copy beyond one per rank would
    share a rank with another copy and balance nothing)."""
    counts = [1] * len(load)
    heap = [(-float(w), e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    full: list[tuple[float, int]] = []
    for _ in range(num_slots - len(load)):
        if not heap:  # more spare slots than copies that help: fill past the cap
            heap, full = full, []
            heapq.heapify(heap)
        _, e = heapq.heappop(heap)
        counts[e] += 1
        item = (-float(load[e]) / counts[e], e)
        if cap is not None and counts[e] >= cap:
            full.append(item)
        else:
            heapq.heappush(heap, item)
    return counts


def greedy_placement(load: Sequence[float], num_slots: int, ep_size: int) -> ExpertPlacement:
    """Balance `load` (rows per logical expert) over `ep_size` ranks of `num_slots // ep_size` slots."""
    E = len(load)
    if num_slots < E or num_slots % ep_size:
        raise ValueError(f"{num_slots} slots cannot hold {E} experts evenly over {ep_size} ranks")
    per_rank = num_slots // ep_size
    counts = replica_counts(load, num_slots, cap=ep_size)
    replicas = sorted(((float(load[e]) / counts[e], e) for e in range(E) for _ in range(counts[e])),
                      key=lambda item: (-item[0], item[1]))
    rank_load = [0.0] * ep_size
    held: list[list[int]] = [[] for _ in range(ep_size)]
    for share, e in replicas:
        free = [r for r in range(ep_size) if len(held[r]) < per_rank]
        fresh = [r for r in free if e not in held[r]] or free  # a second copy on one rank balances nothing
        r = min(fresh, key=lambda r: (rank_load[r], len(held[r]), r))
        rank_load[r] += share
        held[r].append(e)
    return ExpertPlacement(num_experts=E, ep_size=ep_size, slots=tuple(e for r in held for e in sorted(r)))
