"""Which data-parallel rank serves a request: prefix affinity, bounded by load.

Each rank keeps its own prefix cache, so a request is cheapest on the rank that already holds the
state of its longest prefix. The router remembers, per rank, the block keys of the prompts (and of
prompt + answer, once finished) it sent there — keyed by the prefix cache's own block hashing
(`chain_keys`, one key names a whole prefix) — and prefers the rank that knows the most leading
blocks of a new prompt. Affinity must not pile a popular prefix onto one rank while another idles:
when the affinity rank has more than `slack` requests in flight beyond the least loaded rank, the
request goes to the least loaded rank instead (which then learns that prefix too).

`choose_rank` is the policy as a pure function of (matched blocks per rank, loads); `Router` adds
the per-rank key index and the routing counters. Ties break the same way every time: fewer
requests, then fewer tokens, then the lower rank.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.engine.prefix_keys import chain_keys

#: why a request went where it went (the /metrics label)
Reason = Literal["affinity", "overloaded", "load", "round_robin"]
#: block keys remembered per rank (32 bytes each, LRU): far more than a prefix cache usually holds
DEFAULT_KEYS_PER_RANK = 1 << 16


class NoRankAvailable(RuntimeError):
    """Every rank is down."""


class RankLoad(BaseModel):
    """What the router knows of one rank: requests and tokens (prompt + max output) in flight."""

    model_config = ConfigDict(frozen=True)

    requests: int = Field(0, ge=0)
    tokens: int = Field(0, ge=0)
    alive: bool = True


class Route(NamedTuple):
    rank: int
    reason: Reason
    matched_blocks: int  # leading blocks of the prompt the chosen rank has seen


class RouterConfig(BaseModel):
    """`deepinfer serve --dp-routing ... --dp-affinity-slack ...`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["affinity", "round_robin"] = "affinity"
    #: requests in flight the affinity rank may have beyond the least loaded rank
    slack: int = Field(4, ge=0)
    keys_per_rank: int = Field(DEFAULT_KEYS_PER_RANK, ge=1)


def _least_loaded(alive: list[int], loads: Sequence[RankLoad]) -> int:
    return min(alive, key=lambda r: (loads[r].requests, loads[r].tokens, r))


def choose_rank(matches: Sequence[int], loads: Sequence[RankLoad], slack: int) -> Route:
    """The affinity policy. `matches[r]`: leading blocks of the prompt known on rank r."""
    if len(matches) != len(loads):
        raise ValueError(f"{len(matches)} match counts for {len(loads)} ranks")
    alive = [r for r, load in enumerate(loads) if load.alive]
    if not alive:
        raise NoRankAvailable("every data-parallel rank is down")
    least = _least_loaded(alive, loads)
    best = min(alive, key=lambda r: (-matches[r], loads[r].requests, loads[r].tokens, r))
    if matches[best] == 0:
        return Route(least, "load", 0)
    if loads[best].requests - loads[least].requests <= slack:
        return Route(best, "affinity", matches[best])
    return Route(least, "overloaded", matches[least])


class Router:
    """The key index and counters around `choose_rank`. `block_tokens` None (no prefix cache on the
    ranks): there is nothing to be near, so every request goes to the least loaded rank."""

    def __init__(self, num_ranks: int, block_tokens: int | None, config: RouterConfig | None = None):
        if num_ranks < 1:
            raise ValueError(f"num_ranks {num_ranks} must be >= 1")
        self.config = config or RouterConfig()
        self.block_tokens = block_tokens
        self._known: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_ranks)]
        self._next = 0  # round robin
        self.counts: Counter[str] = Counter()  # by reason
        self.per_rank: Counter[int] = Counter()  # requests routed to each rank

    @property
    def num_ranks(self) -> int:
        return len(self._known)

    def keys(self, token_ids: Sequence[int], lookup: bool) -> list[bytes]:
        """Block keys of a prompt: the blocks a lookup may restore (all but the last token must be
        computed), or all full blocks when recording."""
        if self.block_tokens is None:
            return []
        n = (len(token_ids) - (1 if lookup else 0)) // self.block_tokens
        return chain_keys(token_ids, max(n, 0), self.block_tokens)

    def matches(self, keys: list[bytes]) -> list[int]:
        out = []
        for known in self._known:
            n = 0
            while n < len(keys) and keys[n] in known:
                n += 1
            out.append(n)
        return out

    def route(self, token_ids: Sequence[int], loads: Sequence[RankLoad]) -> Route:
        """Pick a rank for a prompt and remember its blocks there."""
        if len(loads) != self.num_ranks:
            raise ValueError(f"{len(loads)} loads for {self.num_ranks} ranks")
        if self.config.policy == "round_robin":
            route = self._round_robin(loads)
        else:
            route = choose_rank(self.matches(self.keys(token_ids, lookup=True)), loads, self.config.slack)
        self.counts[route.reason] += 1
        self.per_rank[route.rank] += 1
        self.remember(route.rank, token_ids)
        return route

    def remember(self, rank: int, token_ids: Sequence[int]) -> None:
        """`token_ids` (a prompt, or a prompt and its answer) now have their state on `rank`."""
        known = self._known[rank]
        # leaf first, so a prefix is always more recent than its extensions and is evicted after them
        for key in reversed(self.keys(token_ids, lookup=False)):
            known[key] = None
            known.move_to_end(key)
        while len(known) > self.config.keys_per_rank:
            known.popitem(last=False)

    def forget(self, rank: int) -> None:
        """The rank is gone (its cache with it)."""
        self._known[rank].clear()

    def _round_robin(self, loads: Sequence[RankLoad]) -> Route:
        for i in range(self.num_ranks):
            rank = (self._next + i) % self.num_ranks
            if loads[rank].alive:
                self._next = rank + 1
                return Route(rank, "round_robin", 0)
        raise NoRankAvailable("every data-parallel rank is down")
