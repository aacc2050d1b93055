"""The parallel layout: --ep/--dp/--cp rules and the ranks they give.

- `--dp` defaults to `ep // cp` (at least 1);
- the world size is `dp x cp`, and it must be divisible by `ep`;
- one process per data-parallel rank, each with `cp` consecutive devices from DEVICE_OFFSET;
- several nodes: RANK (node index) and WORLD_SIZE (node count), defaults 0 and 1; each node runs
  an equal share of the DP ranks, so dp must be divisible by the number of nodes.

Groups: CP group g is the global ranks `g*cp … g*cp+cp-1` (one DP rank's processes); EP group e
is the global ranks `e*ep … e*ep+ep-1`. So with ep < cp several EP groups sit inside one CP group,
and with ep > cp one EP group is made of several whole CP groups, which step on their own requests
(the EP idle lockstep covers them). `check_runnable` refuses a layout where neither of ep and cp
divides the other: there a CP group would straddle two EP groups (see its message).
"""
from __future__ import annotations

import os
from typing import Mapping

from pydantic import BaseModel, ConfigDict, Field

#: --ep when it is not given: 8 on an accelerator node, 1 on the CPU back end.
DEFAULT_EP = {"cpu": 1}
ACCELERATOR_DEFAULT_EP = 8


class ParallelConfigError(ValueError):
    """The --ep/--dp/--cp combination (or the launcher environment) is invalid or not supported here."""


class ParallelLayout(BaseModel):
    """Sizes of one launch; `nodes`/`node_rank` come from WORLD_SIZE/RANK."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ep: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    nodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    @property
    def dp_per_node(self) -> int:
        return self.dp // self.nodes

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def local_ranks(self) -> range:
        """The global ranks this node runs: `cp` consecutive ranks (one CP group) per DP rank."""
        first = self.node_rank * self.dp_per_node * self.cp
        return range(first, first + self.dp_per_node * self.cp)

    def ep_group(self, rank: int) -> range:
        """The global ranks of `rank`'s expert-parallel group (`ep` consecutive ranks)."""
        return _block(rank, self.ep, self.world_size)

    def cp_group(self, rank: int) -> range:
        """The global ranks of `rank`'s context-parallel group: its DP rank's `cp` processes."""
        return _block(rank, self.cp, self.world_size)

    def ep_groups(self) -> list[range]:
        """Every EP group, in rank order."""
        return [range(s, s + self.ep) for s in range(0, self.world_size, self.ep)]

    def cp_groups(self) -> list[range]:
        """Every CP group (one per DP rank), in rank order."""
        return [range(s, s + self.cp) for s in range(0, self.world_size, self.cp)]

    def describe(self) -> str:
        nodes = f", {self.nodes} nodes" if self.nodes > 1 else ""
        return f"ep={self.ep} dp={self.dp} cp={self.cp} (world size {self.world_size}{nodes})"


def _block(rank: int, size: int, world: int) -> range:
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world} ranks")
    start = rank - rank % size
    return range(start, start + size)


def env_int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    """An integer launcher variable (WORLD_SIZE, RANK, ...): `default` when unset, checked against `minimum`."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ParallelConfigError(f"{name}={raw!r} is not an integer; set a whole number or unset it") from None
    if value < minimum:
        raise ParallelConfigError(f"{name}={value} must be >= {minimum}")
    return value


def resolve_layout(ep: int | None, dp: int | None, cp: int, accelerator: str,
                   env: Mapping[str, str] | None = None) -> ParallelLayout:
    """Apply the rules to --ep/--dp/--cp and the node variables; ParallelConfigError names the fix."""
    env = os.environ if env is None else env
    if ep is None:
        ep = DEFAULT_EP.get(accelerator, ACCELERATOR_DEFAULT_EP)
    for name, value in (("--ep", ep), ("--cp", cp)) + ((("--dp", dp),) if dp is not None else ()):
        if value < 1:
            raise ParallelConfigError(f"{name} {value} must be >= 1")
    if dp is None:
        dp = max(ep // cp, 1)
    world = dp * cp
    if world % ep:
        raise ParallelConfigError(
            f"world size dp x cp = {dp} x {cp} = {world} must be divisible by --ep {ep}; "
            f"choose --dp so that dp x cp is a multiple of ep (without --dp, dp = ep // cp = {max(ep // cp, 1)})")
    nodes = env_int(env, "WORLD_SIZE", 1, 1)
    node_rank = env_int(env, "RANK", 0, 0)
    if node_rank >= nodes:
        raise ParallelConfigError(f"RANK={node_rank} must be smaller than WORLD_SIZE={nodes}")
    if dp % nodes:
        raise ParallelConfigError(f"dp={dp} must be divisible by the number of nodes WORLD_SIZE={nodes}: each node "
                                  f"runs an equal share of the data-parallel ranks")
    return ParallelLayout(ep=ep, dp=dp, cp=cp, nodes=nodes, node_rank=node_rank)


def check_runnable(layout: ParallelLayout) -> None:
    """Refuse, before any process starts, a valid layout this release cannot run."""
    if layout.ep % layout.cp and layout.cp % layout.ep:
        raise ParallelConfigError(
            f"{layout.describe()}: each expert-parallel group must lie inside one context-parallel group (ep "
            f"dividing cp) or be made of whole CP groups (ep a multiple of cp); with ep {layout.ep} and cp "
            f"{layout.cp} a CP group would straddle two EP groups, and its ranks, which step together, could "
            f"wait on each other from two EP groups' idle lockstep; choose ep and cp so that one divides the other")
