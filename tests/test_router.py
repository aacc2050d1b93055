"""The data-parallel router of `deepinfer serve --dp N` (core/server/router.py), without a server:
prefix affinity against the load slack, deterministic ties, dead ranks, the per-rank key index."""
from __future__ import annotations

import pytest

from deepinfer.engine.prefix_keys import chain_keys
from deepinfer.server.router import NoRankAvailable, RankLoad, Router, RouterConfig, choose_rank

B = 4  # block tokens


def loads(*requests: int, tokens: tuple[int, ...] = (), down: tuple[int, ...] = ()) -> list[RankLoad]:
    tokens = tokens or (0,) * len(requests)
    return [RankLoad(requests=r, tokens=t, alive=i not in down) for i, (r, t) in enumerate(zip(requests, tokens))]


def test_affinity_wins_within_the_slack_and_loses_beyond_it():
    assert choose_rank([0, 3], loads(0, 2), slack=2) == (1, "affinity", 3)
    assert choose_rank([0, 3], loads(0, 3), slack=2) == (0, "overloaded", 0)
    assert choose_rank([1, 3], loads(0, 3), slack=2) == (0, "overloaded", 1)
    assert choose_rank([0, 3], loads(5, 7), slack=2) == (1, "affinity", 3)  # measured against the least loaded
    assert choose_rank([0, 3], loads(0, 1), slack=0) == (0, "overloaded", 0)


def test_without_a_known_prefix_the_least_loaded_rank_gets_it():
    assert choose_rank([0, 0, 0], loads(2, 1, 3), slack=4) == (1, "load", 0)
    assert choose_rank([0, 0], loads(1, 1, tokens=(90, 10)), slack=4) == (1, "load", 0)  # then fewer tokens


def test_ties_break_deterministically():
    assert choose_rank([0, 0, 0], loads(1, 1, 1), slack=4).rank == 0
    assert choose_rank([2, 2], loads(0, 0), slack=4).rank == 0  # equal prefixes, equal loads: lower rank
    assert choose_rank([2, 2], loads(1, 0), slack=4).rank == 1  # equal prefixes: the less loaded
    assert choose_rank([2, 2], loads(0, 0, tokens=(50, 5)), slack=4).rank == 1
    assert choose_rank([2, 3], loads(0, 2), slack=4).rank == 1  # the longer prefix within the slack


def test_dead_ranks_are_skipped_and_none_left_is_an_error():
    assert choose_rank([0, 5], loads(3, 0, down=(1,)), slack=4) == (0, "load", 0)
    assert choose_rank([0, 0], loads(0, 0, down=(0,)), slack=4).rank == 1
    with pytest.raises(NoRankAvailable, match="every data-parallel rank is down"):
        choose_rank([0, 0], loads(0, 0, down=(0, 1)), slack=4)
    with pytest.raises(ValueError, match="2 match counts for 3 ranks"):
        choose_rank([0, 0], loads(0, 0, 0), slack=4)


def test_a_follow_up_turn_goes_where_its_prefix_went():
    router = Router(2, block_tokens=B, config=RouterConfig(slack=2))
    turn1, other = list(range(10)), list(range(100, 110))
    assert router.route(turn1, loads(1, 0)) == (1, "load", 0)  # rank 0 busy with something else
    assert router.route(other, loads(1, 1)) == (0, "load", 0)
    router.remember(1, turn1 + [50, 51, 52, 53, 54, 55])  # turn 1 finished with its answer
    turn2 = turn1 + [50, 51, 52, 53, 54, 55, 60, 61]
    assert router.route(turn2, loads(0, 1)) == (1, "affinity", 4)  # 16 answered tokens = 4 blocks
    assert router.route(other + [7], loads(0, 3)) == (0, "affinity", 2)
    assert router.route(turn2, loads(0, 3)) == (0, "overloaded", 0)  # rank 1 too busy; rank 0 learns it
    assert router.matches(router.keys(turn2, lookup=True))[0] == 4
    assert router.counts == {"load": 2, "affinity": 2, "overloaded": 1}
    assert router.per_rank == {0: 3, 1: 2}


def test_only_whole_blocks_before_the_last_token_count():
    router = Router(2, block_tokens=B)
    router.remember(1, list(range(8)))
    assert router.matches(router.keys(list(range(8)), lookup=True)) == [0, 1]  # the last token is computed
    assert router.matches(router.keys(list(range(9)), lookup=True)) == [0, 2]
    assert router.keys(list(range(3)), lookup=True) == []
    assert router.keys(list(range(9)), lookup=False) == chain_keys(list(range(9)), 2, B)


def test_the_index_is_lru_and_keeps_prefixes_over_their_extensions():
    router = Router(1, block_tokens=B, config=RouterConfig(keys_per_rank=3))
    router.remember(0, list(range(12)))  # 3 blocks
    router.remember(0, list(range(4)) + [99] * 4 + [7])  # shares block 1; evicts the oldest leaf
    assert router.matches(router.keys(list(range(13)), lookup=True)) == [2]
    assert router.matches(router.keys(list(range(4)) + [99] * 4 + [7], lookup=True)) == [2]
    router.forget(0)
    assert router.matches(router.keys(list(range(13)), lookup=True)) == [0]


def test_no_prefix_cache_means_least_loaded_and_round_robin_rotates_over_live_ranks():
    router = Router(2, block_tokens=None)
    router.remember(1, list(range(64)))
    assert router.route(list(range(64)), loads(0, 0)) == (0, "load", 0)
    rr = Router(3, block_tokens=B, config=RouterConfig(policy="round_robin"))
    ranks = [rr.route([1, 2, 3, 4, 5], loads(0, 0, 0, down=(1,))).rank for _ in range(4)]
    assert ranks == [0, 2, 0, 2]
    with pytest.raises(NoRankAvailable):
        rr.route([1], loads(0, 0, 0, down=(0, 1, 2)))
    with pytest.raises(ValueError, match="slack"):
        RouterConfig(slack=-1)
