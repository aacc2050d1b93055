"""Context parallelism: the ranks of a CP group share one step's long prefill.

Zig-zag split: each sequence's new tokens are cut into 2N chunks (N = CP size, chunk k covers
rows `k*n // 2N … (k+1)*n // 2N`); rank i takes chunks i and 2N-1-i, an early and a late one, so
every rank gets the same number of tokens and about the same causal attention work.

Each rank runs the layers on its own rows only. Whatever a layer's attention reads from other
tokens (window keys, compressor inputs, ...) the model gathers from the group with `gather`: every
rank then holds the whole step's rows of it, in the step's row order, and writes the same cache
state a single rank would; it computes attention only for its own query rows. Every rank of the
group therefore ends the step with the full cache state, and steps that are not split (decode,
short chunks) run on every rank alike, in lockstep. The ranks must hold bitwise-identical state,
so under expert parallelism the MoE layers of a step that is not split compute each row once
(each rank its share, outputs gathered: deepinfer.models.deepseek_v4.moe) instead of sending
every rank's copy to the experts, where the copies would meet different expert batches.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

import torch

from deepinfer.accelerator.interface import Collectives
from deepinfer.parallel.groups import GroupCollectives


def zigzag_bounds(n: int, size: int) -> list[int]:
    """Row offsets of the 2·size chunks of a sequence of `n` rows (2·size + 1 values, 0 … n)."""
    chunks = 2 * size
    return [k * n // chunks for k in range(chunks + 1)]


def zigzag_owner(chunk: int, size: int) -> int:
    """The rank that takes chunk `chunk` (0 … 2·size-1): rank i takes chunks i and 2·size-1-i."""
    return chunk if chunk < size else 2 * size - 1 - chunk


@dataclass(frozen=True)
class LocalChunk:
    """A run of consecutive rows of one sequence that this rank computes."""

    seq: int  # the sequence's index in the step
    start: int  # first row, counted from the sequence's first new token
    stop: int  # one past the last
    local_row: int  # where the run starts among this rank's rows


@dataclass
class RowSplit:
    """Which rank computes which row of one step (`q_lens`: new tokens per sequence)."""

    q_lens: list[int]
    rank: int
    size: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: ContextParallel | None = None  # what `gather` exchanges through

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of a per-row tensor -> the step's rows (`ContextParallel.gather`)."""
        if self.group is None:
            raise RuntimeError("this row split has no context-parallel group to gather over")
        return self.group.gather(local, self)

    @cached_property
    def rows_of(self) -> list[list[int]]:
        """The step's rows of every rank, in row order."""
        out: list[list[int]] = [[] for _ in range(self.size)]
        start = 0
        for n in self.q_lens:
            b = zigzag_bounds(n, self.size)
            for k in range(2 * self.size):
                out[zigzag_owner(k, self.size)].extend(range(start + b[k], start + b[k + 1]))
            start += n
        return out

    @property
    def num_rows(self) -> int:
        return sum(self.q_lens)

    @cached_property
    def local_rows(self) -> torch.Tensor:
        """This rank's rows of the step, `[T_local]` (ascending)."""
        return torch.tensor(self.rows_of[self.rank], dtype=torch.long, device=self.device)

    @cached_property
    def chunks(self) -> list[LocalChunk]:
        """This rank's rows as runs of consecutive positions of one sequence each (its two chunks of
        every sequence, empty ones left out), in local row order."""
        out, local = [], 0
        for i, n in enumerate(self.q_lens):
            b = zigzag_bounds(n, self.size)
            for k in sorted((self.rank, 2 * self.size - 1 - self.rank)):
                if b[k + 1] > b[k]:
                    out.append(LocalChunk(i, b[k], b[k + 1], local))
                    local += b[k + 1] - b[k]
        return out

    @cached_property
    def width(self) -> int:
        """Rows every rank contributes to a gather (the largest share; the others pad)."""
        return max(len(r) for r in self.rows_of)

    @cached_property
    def assemble(self) -> torch.Tensor:
        """For every row of the step, its index in the gathered, padded `[size * width]` rows."""
        index = torch.empty(self.num_rows, dtype=torch.long)
        for r, rows in enumerate(self.rows_of):
            index[torch.tensor(rows, dtype=torch.long)] = r * self.width + torch.arange(len(rows))
        return index.to(self.device)


@dataclass
class CollectiveTime:
    """Time and volume of this rank's CP gathers (for benchmarks; reset with `reset`)."""

    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0

    def reset(self) -> None:
        self.calls, self.seconds, self.bytes = 0, 0.0, 0


class ContextParallel:
    """This rank's view of its CP group: `collectives` are the group's (`groups.GroupCollectives`,
    or a back end's own when the group is the whole world), `rank` and `size` its place in it."""

    def __init__(self, collectives: Collectives | GroupCollectives, rank: int, size: int,
                 device: torch.device | str = "cpu"):
        if size < 2 or not 0 <= rank < size:
            raise ValueError(f"a context-parallel group needs size >= 2 and 0 <= rank < size; got rank {rank} "
                             f"of {size}")
        self.collectives, self.rank, self.size, self.device = collectives, rank, size, torch.device(device)
        self.timing = CollectiveTime()

    def smallest(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the cache budget, so all size one pool)."""
        mine = torch.tensor([value], dtype=torch.long, device=self.device)
        return int(self.collectives.all_gather(mine).min())

    def split(self, q_lens: list[int], device: torch.device) -> RowSplit:
        return RowSplit(list(q_lens), self.rank, self.size, torch.device(device), self)

    def gather(self, local: torch.Tensor, split: RowSplit) -> torch.Tensor:
        """Every rank's rows of a per-row tensor (`local`: this rank's `[T_local, ...]`) -> the
        step's `[T, ...]` in row order, identical on every rank of the group."""
        if local.shape[0] != len(split.rows_of[self.rank]):
            raise ValueError(f"rank {self.rank} gathers {local.shape[0]} rows but computes "
                             f"{len(split.rows_of[self.rank])} of this step")
        start = time.perf_counter()
        padded = local.new_zeros((split.width, *local.shape[1:]))
        padded[:local.shape[0]] = local
        gathered = self.collectives.all_gather(padded)
        self.timing.calls += 1
        self.timing.bytes += gathered.numel() * gathered.element_size()
        self.timing.seconds += time.perf_counter() - start
        return gathered.index_select(0, split.assemble)


_CURRENT: ContextParallel | None = None


def current_context_parallel() -> ContextParallel | None:
    """The CP group this process's model splits long prefills over, or None."""
    return _CURRENT


def set_context_parallel(cp: ContextParallel | None) -> None:
    global _CURRENT
    _CURRENT = cp
