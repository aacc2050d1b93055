"""The parallel layout: --ep/--dp/--cp rules and the ranks they give.

- `--dp` defaults to `ep // cp` (at least 1);
- the world size is `dp x cp`, and it must be divisible by `ep`;
- one process per data-parallel rank, each with `cp` consecutive devices from DEVICE_OFFSET;
- several nodes: RANK (node index) and WORLD_SIZE (node count), defaults 0 and 1; each node runs
  an equal share of the DP ranks, so dp must be divisible by the number of nodes.

What runs today (checked by `check_runnable`): ep either 1 or the whole world (one EP group
spanning every rank), and either cp = 1 or dp = 1 (one CP group spanning every rank).
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

    def describe(self) -> str:
        nodes = f", {self.nodes} nodes" if self.nodes > 1 else ""
        return f"ep={self.ep} dp={self.dp} cp={self.cp} (world size {self.world_size}{nodes})"


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
    if layout.cp > 1 and layout.dp > 1:
        raise ParallelConfigError(
            f"{layout.describe()}: context parallelism runs one CP group spanning every rank in this release "
            f"(--dp 1 --cp {layout.world_size}); several CP groups (dp > 1 with cp > 1) need sub-group "
            f"collectives, which are not implemented")
    if layout.ep not in (1, layout.world_size):
        raise ParallelConfigError(
            f"{layout.describe()}: the expert-parallel group must be 1 rank or span the whole world "
            f"(--ep {layout.world_size}) in this release; several EP groups (ep < dp x cp) are not implemented")
