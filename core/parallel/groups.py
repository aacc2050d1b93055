"""The process groups of a launch: each rank's expert-parallel and context-parallel group, made
through the back end's `Collectives` at start-up, and a view of the collectives bound to one group.

Which ranks form which group is the layout's (`ParallelLayout.ep_groups` / `cp_groups`). A group
that spans the whole world uses the default process group (its collectives are called without a
`group` argument, so a back end written against interface 2.2 runs it); smaller groups are made
with `Collectives.new_group`, which torch.distributed requires every rank of the world to call for
every group in the same order: `make_groups` creates all EP groups, then all CP groups, on every
rank, before the model is built.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from deepinfer.accelerator.interface import Collectives
from deepinfer.parallel.layout import ParallelConfigError, ParallelLayout

_GROUP_OPS = ("all_reduce", "all_gather", "all_to_all")


class GroupCollectives:
    """The collectives of one group of ranks: the back end's, with its `group` handle bound.
    `rank` and `size` are this process's place in the group (what ExpertParallel and
    ContextParallel call rank and size)."""

    def __init__(self, collectives: Collectives, ranks: range, global_rank: int, handle: object | None = None):
        if global_rank not in ranks:
            raise ValueError(f"rank {global_rank} is not a member of the group of ranks {list(ranks)}")
        self.collectives, self.ranks, self.handle = collectives, ranks, handle
        self.rank, self.size = ranks.index(global_rank), len(ranks)

    def _group(self) -> dict[str, object]:
        return {} if self.handle is None else {"group": self.handle}

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce(tensor, **self._group())

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_gather(tensor, **self._group())

    def all_to_all(self, tensor: torch.Tensor, input_splits: list[int], output_splits: list[int]) -> torch.Tensor:
        return self.collectives.all_to_all(tensor, input_splits, output_splits, **self._group())

    def __repr__(self) -> str:
        return f"GroupCollectives(ranks {self.ranks.start}..{self.ranks.stop - 1}, rank {self.rank} of {self.size})"


@dataclass(frozen=True)
class RankGroups:
    """This rank's EP group (None with ep 1) and CP group (None with cp 1)."""

    ep: GroupCollectives | None
    cp: GroupCollectives | None


def needs_subgroups(layout: ParallelLayout) -> bool:
    """Does the layout have several EP groups or several CP groups (groups smaller than the world)?"""
    return any(1 < size < layout.world_size for size in (layout.ep, layout.cp))


def supports_subgroups(collectives: type[Collectives] | Collectives) -> bool:
    """The back end implements `new_group` and takes `group` in every collective (interface 2.3)."""
    cls = collectives if isinstance(collectives, type) else type(collectives)
    if cls.new_group is Collectives.new_group:
        return False
    return all("group" in inspect.signature(getattr(cls, op)).parameters for op in _GROUP_OPS)


def check_subgroups(layout: ParallelLayout, accelerator: type[Collectives], name: str) -> None:
    """Refuse, before any process starts, a layout with several EP or CP groups on a back end
    without sub-groups."""
    if needs_subgroups(layout) and not supports_subgroups(accelerator):
        raise ParallelConfigError(
            f"{layout.describe()} has several expert- or context-parallel groups, which need sub-group "
            f"collectives, but the {name} back end does not implement Collectives.new_group with a `group` "
            f"argument on all_reduce/all_gather/all_to_all (interface 2.3); use ep and cp of 1 or the whole "
            f"world (dp x cp), or a back end that has them")


def make_groups(collectives: Collectives, layout: ParallelLayout, rank: int) -> RankGroups:
    """Collective over the world (every rank, after `init_process_group`): create every EP group,
    then every CP group, in rank order, and return this rank's two."""

    def mine(size: int, groups: list[range]) -> GroupCollectives | None:
        if size == 1:
            return None
        if size == layout.world_size:
            return GroupCollectives(collectives, range(layout.world_size), rank)
        handles = [collectives.new_group(list(g)) for g in groups]  # all of them, on every rank
        index = next(i for i, g in enumerate(groups) if rank in g)
        return GroupCollectives(collectives, groups[index], rank, handles[index])

    return RankGroups(ep=mine(layout.ep, layout.ep_groups()), cp=mine(layout.cp, layout.cp_groups()))
