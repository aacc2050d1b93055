"""Parallel sizes and the per-rank launcher of the examples (the seeds' examples/_launch.py rules).

- `--dp` defaults to `ep // cp` (at least 1);
- the world size is `dp x cp`, and it must be divisible by `ep`;
- one process per data-parallel rank, each with `cp` consecutive devices from DEVICE_OFFSET;
- multi-node: RANK (node index) and WORLD_SIZE (number of nodes), defaults 0 and 1; each node runs
  an equal share of the DP ranks, so dp must be divisible by the number of nodes.

This engine runs one process on one device until expert/data/context parallelism lands, so today
every size must resolve to 1; anything else is refused with a message saying so.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping

#: --ep when it is not given: the seeds' 8 on an accelerator node, 1 on the CPU back end.
DEFAULT_EP = {"cpu": 1}
ACCELERATOR_DEFAULT_EP = 8


class ParallelConfigError(ValueError):
    """The --ep/--dp/--cp combination is invalid or not supported here."""


@dataclass(frozen=True)
class ParallelSizes:
    ep: int
    dp: int
    cp: int
    nodes: int = 1
    node_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    @property
    def dp_per_node(self) -> int:
        return self.dp // self.nodes


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


def resolve_parallel(ep: int | None, dp: int | None, cp: int, accelerator: str,
                     env: Mapping[str, str] | None = None) -> ParallelSizes:
    """Apply the seeds' rules to --ep/--dp/--cp; raises ParallelConfigError with the fix."""
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
    sizes = ParallelSizes(ep=ep, dp=dp, cp=cp, nodes=nodes, node_rank=node_rank)
    if (ep, dp, cp, nodes) != (1, 1, 1, 1):
        raise ParallelConfigError(
            f"ep={ep}, dp={dp}, cp={cp} (world size {world}, {nodes} node{'s' if nodes > 1 else ''}) is a valid "
            f"layout, but this release runs one process on one device: use --ep 1 --dp 1 --cp 1"
            + (" (the CPU back end's default)" if accelerator == "cpu" else "")
            + ". Expert, data and context parallelism come in a later release.")
    return sizes


def launch_dp(main: Callable[[int, ParallelSizes], None], sizes: ParallelSizes) -> None:
    """Run `main(dp_rank, sizes)` once per data-parallel rank of this node (one rank today)."""
    first = sizes.node_rank * sizes.dp_per_node
    for rank in range(first, first + sizes.dp_per_node):
        main(rank, sizes)
