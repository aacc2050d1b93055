"""Parallel layout of a benchmark run, as the seeds define it.

The parallel scale is `WORLD_SIZE x devices per node`, where devices per node is the length of
`CUDA_VISIBLE_DEVICES` on an accelerator and 1 on the CPU back end. Expert parallelism spans the
whole scale (ep = scale); context parallelism `--cp` must divide it, and the remaining factor is data
parallelism (dp = scale / cp). `--decode_num_requests` counts requests per data-parallel group, so
the whole run decodes `decode_num_requests x dp` sequences.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from deepinfer.parallel.layout import env_int


@dataclass(frozen=True)
class Layout:
    world_size: int  # nodes (processes launched with WORLD_SIZE / RANK)
    rank: int
    devices_per_node: int
    cp: int

    @property
    def scale(self) -> int:
        """Devices in the run: WORLD_SIZE x devices per node (= ep size)."""
        return self.world_size * self.devices_per_node

    @property
    def dp(self) -> int:
        return self.scale // self.cp

    @property
    def ep(self) -> int:
        return self.scale


def devices_per_node(accelerator: str, env: Mapping[str, str]) -> int:
    """1 on the CPU back end; otherwise the number of entries in CUDA_VISIBLE_DEVICES."""
    if accelerator == "cpu":
        return 1
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip() != ""]
    if not visible:
        raise ValueError(f"CUDA_VISIBLE_DEVICES is unset or empty, so the parallel scale of accelerator "
                         f"'{accelerator}' is unknown; export the devices you use, e.g. "
                         f"CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7")
    return len(visible)


def validate_cp(cp: int, scale: int, how: str = "") -> None:
    """`--cp` must be a positive divisor of the parallel scale."""
    if cp < 1:
        raise ValueError(f"--cp {cp} must be >= 1")
    if scale % cp:
        divisors = [d for d in range(1, scale + 1) if scale % d == 0]
        raise ValueError(f"--cp {cp} must divide the parallel scale {scale}{how}; choose --cp from "
                         f"{divisors}, or change WORLD_SIZE / CUDA_VISIBLE_DEVICES")


def resolve_layout(cp: int, accelerator: str, env: Mapping[str, str]) -> Layout:
    """Read WORLD_SIZE, RANK and CUDA_VISIBLE_DEVICES from `env` and check `--cp` against them."""
    world = env_int(env, "WORLD_SIZE", 1, 1)
    rank = env_int(env, "RANK", 0, 0)
    if rank >= world:
        raise ValueError(f"RANK={rank} must be smaller than WORLD_SIZE={world}")
    per_node = devices_per_node(accelerator, env)
    how = (f" (WORLD_SIZE {world} x {per_node} device{'s' if per_node > 1 else ''} per node"
           + (", CPU back end" if accelerator == "cpu" else f", CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')}")
           + ")")
    validate_cp(cp, world * per_node, how)
    return Layout(world_size=world, rank=rank, devices_per_node=per_node, cp=cp)
