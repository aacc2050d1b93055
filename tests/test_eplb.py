"""The eplb feature: the redundant-expert rounding rule, the greedy placement, the placement hook
(overridable by a third party), weight moves, and on two gloo ranks (--ep 2, fp32): EPLB on, off
(what --disable_eplb writes) and re-placed at every step give the single-process greedy tokens
(V4 and V4.1), and under batch-invariant kernels the same logprob bits; on four ranks in two EP
groups each group balances its own load."""
from __future__ import annotations

import json
import os
import logging
from pathlib import Path

import pytest
import torch

from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.parallel.expert_parallel import ExpertParallel
from deepinfer.parallel.expert_placement import ExpertLoad, ExpertPlacement, Router
from deepinfer.parallel.launch import launch
from deepinfer.parallel.layout import ParallelLayout
from deepinfer_plugins.features.eplb import EplbConfig, greedy_placement, physical_slots
from deepinfer_plugins.features.eplb.policy import replica_counts
from example_modules import load_example


def _example():
    return load_example("offline_inference.py")


# ------------------------------------------------------------------------------ rounding rule


@pytest.mark.parametrize("experts, extra, ep, slots", [
    (256, 32, 8, 288),  # already divisible
    (32, 32, 2, 64),
    (32, 1, 2, 34),  # 33 -> 34
    (32, 3, 4, 36),  # 35 -> 36
    (32, 0, 4, 32),  # no redundancy
    (32, 5, 1, 37),  # ep 1: any total divides
    (30, 0, 4, 32),  # rounding alone adds replicas
])
def test_extra_experts_are_a_lower_bound_rounded_up_to_a_multiple_of_ep(experts, extra, ep, slots):
    assert physical_slots(experts, extra, ep) == slots


@pytest.mark.parametrize("extra", [-1, 1.5, True, "4"])
def test_a_bad_extra_expert_count_is_refused(extra):
    with pytest.raises(ValueError, match="DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"):
        physical_slots(32, extra, 2)
    with pytest.raises(ValueError, match="num_extra_experts.*DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"):
        EplbConfig(num_extra_experts=extra)


def test_the_environment_variable_configures_the_feature(clean_env):
    from deepinfer.config import load_config, resolve_feature_configs

    clean_env.setenv("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "16")
    configs = resolve_feature_configs(load_config(), {"eplb": EplbConfig})
    assert configs["eplb"] == EplbConfig(num_extra_experts=16)
    for bad, message in (("-3", "must be >= 0"), ("lots", "is not an integer")):
        clean_env.setenv("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", bad)
        with pytest.raises(ValueError, match=message):
            resolve_feature_configs(load_config(), {"eplb": EplbConfig})


def test_disable_eplb_wins_over_the_environment(clean_env):
    from deepinfer.config import EngineConfig
    from deepinfer.plugins import load_accelerator_class, load_features

    example = _example()
    args = example.parse_args(["--disable_eplb"])
    assert example.apply_seed_env_defaults("cpu", args.disable_eplb, cannot_draft=lambda: "no") == {}
    assert "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS" not in os.environ
    clean_env.setenv("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "8")  # set by the user as well
    cpu = load_accelerator_class("cpu")()
    assert "eplb" not in load_features(EngineConfig(features=example.feature_tables(args)), cpu).configs
    assert load_features(EngineConfig(), cpu).configs["eplb"].num_extra_experts == 8  # without the flag: on


# ------------------------------------------------------------------------------ placement


def rank_loads(placement: ExpertPlacement, load: list[float]) -> list[float]:
    """Rows per rank if each expert's rows split evenly over its replicas."""
    counts = placement.replica_counts()
    return [sum(load[e] / counts[e] for e in placement.rank_slots(r)) for r in range(placement.ep_size)]


def test_greedy_placement_covers_every_expert_and_balances_a_skewed_load():
    E, ep = 32, 4
    load = [1000.0 / (e + 1) for e in range(E)]  # Zipf: expert 0 is hot
    load = load[5:] + load[:5]  # the hot experts are not the first ids
    placement = greedy_placement(load, physical_slots(E, 8, ep), ep)
    assert placement.num_slots == 40 and placement.slots_per_rank == 10
    counts = placement.replica_counts()
    assert min(counts) >= 1 and sum(counts) == 40
    hottest = max(range(E), key=load.__getitem__)
    assert counts[hottest] == max(counts) > 1
    assert all(counts[e] == 1 for e in range(E) if load[e] < 100)  # cold experts get no replica
    balanced = rank_loads(placement, load)
    contiguous = rank_loads(ExpertPlacement.contiguous(E, ep), load)
    mean = sum(load) / ep
    assert max(balanced) / mean < 1.05 < 2.0 < max(contiguous) / mean
    for r in range(ep):  # a replica never shares a rank with another copy of itself
        assert len(set(placement.rank_slots(r))) == placement.slots_per_rank
    assert greedy_placement(load, 40, ep) == placement  # deterministic


def test_no_rank_holds_two_copies_of_an_expert_while_it_can_be_avoided():
    for seed in range(20):
        load = (torch.rand(16, generator=torch.Generator().manual_seed(seed)) ** 4 * 100).tolist()
        placement = greedy_placement(load, 24, 4)
        assert max(placement.replica_counts()) <= 4
        assert all(len(set(placement.rank_slots(r))) == 6 for r in range(4)), seed


def test_replicas_go_to_the_most_loaded_per_copy():
    assert replica_counts([10.0, 1.0, 4.0], 6) == [3, 1, 2]  # 10/3 > 4/2 > 10/4 ...
    assert replica_counts([0.0] * 4, 4) == [1, 1, 1, 1]
    assert replica_counts([10.0, 1.0], 4) == [3, 1]
    assert replica_counts([10.0, 1.0], 4, cap=2) == [2, 2]  # one copy per rank at most while that is possible
    assert replica_counts([10.0, 1.0], 5, cap=2) == [3, 2]


@pytest.mark.parametrize("slots, message", [
    ((0, 1, 2, 2), "experts \\[3\\] without a slot"),
    ((0, 1, 2, 3, 4, 0), "outside 0..3"),
    ((0, 1, 2, 3, 0), "multiple of 2 slots"),
])
def test_an_invalid_placement_is_refused(slots, message):
    with pytest.raises(ValueError, match=message):
        ExpertPlacement(num_experts=4, ep_size=2, slots=slots)


def test_routing_picks_a_replica_by_token_and_rank():
    placement = ExpertPlacement(num_experts=4, ep_size=2, slots=(0, 1, 0, 2, 3, 0))  # expert 0 in slots 0, 2, 5
    ids = torch.tensor([[0, 1], [0, 3], [0, 2], [0, 1]])
    assert Router(placement, 0, torch.device("cpu"))(ids).tolist() == [[0, 1], [2, 4], [5, 3], [0, 1]]
    assert Router(placement, 1, torch.device("cpu"))(ids)[:, 0].tolist() == [2, 5, 0, 2]
    same = ExpertPlacement.contiguous(4, 2)
    assert Router(same, 1, torch.device("cpu"))(ids) is ids  # no balancing: no work


# ------------------------------------------------------------------------------ weight moves


class OneRank:
    """The collectives of a group of one (all_gather and all_to_all return their input)."""

    def all_gather(self, tensor):
        return tensor.clone()

    def all_to_all(self, tensor, input_splits, output_splits):
        assert input_splits == output_splits == [tensor.shape[0]]
        return tensor.clone()


def test_install_gives_every_slot_its_experts_weights():
    E = 4
    w13 = torch.arange(E, dtype=torch.bfloat16).reshape(E, 1, 1).expand(E, 3, 2).contiguous()
    ids = torch.arange(E, dtype=torch.float32).reshape(E, 1, 1)
    q = QuantizedWeight(ids.expand(E, 4, 4).to(torch.float8_e4m3fn), ids + 1, 4, torch.bfloat16)
    given = []  # what the back end is given to prepare (its packed copies of the moved stacks)
    ep = ExpertParallel(OneRank(), 0, 1, torch.device("cpu"), prepare_weights=lambda uses: given.extend(uses))
    key = ep.register(lambda rows, plan: rows, 2, E, [w13, q])
    placement = ExpertPlacement(num_experts=E, ep_size=1, slots=(3, 0, 0, 1, 2, 3))
    ep.install(key, placement)
    moved, mq = ep.weights(key)
    assert [(op, id(w)) for op, w in given] == [("moe_experts", id(moved)), ("moe_experts", id(mq))]
    assert moved.dtype == torch.bfloat16 and moved.shape == (6, 3, 2)
    assert moved[:, 0, 0].tolist() == [3, 0, 0, 1, 2, 3]
    assert mq.data.dtype == torch.float8_e4m3fn and mq.data[:, 0, 0].float().tolist() == [3, 0, 0, 1, 2, 3]
    assert mq.scale[:, 0, 0].tolist() == [4, 1, 1, 2, 3, 4]
    assert ep.num_slots(key) == 6 and ep.placement(key) == placement
    fixed = ep.register(lambda rows, plan: rows, 2, E)
    with pytest.raises(RuntimeError, match="registered without its weights"):
        ep.install(fixed, placement)


def test_load_counts_sum_the_replicas_of_each_expert():
    placement = ExpertPlacement(num_experts=3, ep_size=2, slots=(0, 1, 0, 2))
    load = ExpertLoad(2)
    load.end_round(load.add(5, torch.tensor([4, 1, 2, 3]), placement))
    load.end_round(load.add(5, torch.tensor([1, 0, 0, 0]), placement))
    assert load.expert_rows[5].tolist() == [7, 1, 3] and load.rank_rows.tolist() == [6, 5]
    assert load.imbalance() == pytest.approx(6 / 5.5)
    assert load.rounds == 2 and load.exchange_imbalance() == pytest.approx((5 + 1) / 5.5)


# ------------------------------------------------------------------------------ the hook


THIRD_PARTY = """
import deepinfer
from pydantic import BaseModel
from deepinfer.features import FeatureSpec
from deepinfer.parallel.expert_placement import ExpertPlacement


class Cfg(BaseModel):
    give_up: bool = False


class RoundRobin:
    def __init__(self, config):
        self.config = config

    @staticmethod
    @deepinfer.hookimpl
    def deepinfer_feature_spec():
        return FeatureSpec(name="round_robin", config_model=Cfg, hooks=("deepinfer_expert_placement",))

    @deepinfer.hookimpl
    def deepinfer_expert_placement(self, load, num_slots, ep_size):
        if self.config.give_up:
            return None
        E = load.numel()
        return ExpertPlacement(num_experts=E, ep_size=ep_size, slots=tuple(s % E for s in range(num_slots)))
"""


@pytest.mark.parametrize("give_up", [False, True])
def test_a_third_party_feature_can_replace_the_placement_policy(fake_distribution, clean_env, give_up):
    from deepinfer.config import EngineConfig
    from deepinfer.plugins import load_accelerator_class, load_features

    fake_distribution("rr-placement", "1.0", {"deepinfer.features": {"round_robin": "rr_placement:RoundRobin"}},
                      {"rr_placement": THIRD_PARTY})
    config = EngineConfig(features={"eplb": {}, "round_robin": {"give_up": give_up}})
    features = load_features(config, load_accelerator_class("cpu")())
    load = torch.tensor([0.0, 50.0, 0.0, 1.0])
    eplb = features.pm.get_plugin("eplb")
    eplb._hook, eplb._slots[0] = features.hook, 6  # as engine start sets them
    got = eplb._place(load, 0, 2)
    if give_up:  # None from the third party: the default policy answers
        assert got == greedy_placement(load.tolist(), 6, 2) and got.replica_counts()[1] == 2
    else:
        assert got.slots == (0, 1, 2, 3, 0, 1)


# ------------------------------------------------------------------------------ two gloo ranks


@pytest.fixture(scope="module")
def v4_checkpoint(tiny_v4) -> str:
    return str(tiny_v4)


PROMPTS = ["The capital of France is", "1 2 3 4 5 6 7 8", "a b a b a b", "Once upon a time"]


def eplb_generate(ctx, checkpoint: str, features: dict | None, max_tokens: int) -> dict:
    """Rank target: this DP rank's share of PROMPTS, greedy; what EPLB did on this rank."""
    from deepinfer import LLM
    from deepinfer.parallel.expert_parallel import current_expert_parallel, idle_until_peers_done
    from deepinfer.sampling_params import SamplingParams

    layout = ctx.layout
    llm = LLM(model=checkpoint, accelerator="cpu", dtype="float32", max_num_seqs=2, cache_memory_gb=0.05,
              features=features, ep=layout.ep, dp=layout.dp, cp=layout.cp)
    mine = [i for i in range(len(PROMPTS)) if i % layout.dp == ctx.dp_rank]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
    outs = llm.generate([PROMPTS[i] for i in mine], [params] * len(mine), use_tqdm=False) if mine else []
    idle_until_peers_done()
    ep = current_expert_parallel()
    eplb = llm.engine.features.pm.get_plugin("eplb") if llm.engine.features is not None else None
    result = {"tokens": {i: list(o.outputs[0].token_ids) for i, o in zip(mine, outs)},
              "logprobs": {i: [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                           for i, o in zip(mine, outs)},
              "slots": [ep.placement(k).slots for k in range(ep.num_layers)] if ep else None,
              "rebalances": eplb.rebalances if eplb is not None else None,
              "load": {k: rows.tolist() for k, rows in ep.load.expert_rows.items()} if ep and ep.load else None}
    llm.shutdown()
    return result


def _run(checkpoint: str, layout: ParallelLayout, features: dict | None) -> list[dict]:
    from deepinfer.plugins import load_accelerator_class

    return launch(eplb_generate, (checkpoint, features, 6), layout, load_accelerator_class("cpu"), threads_per_rank=1)


def _tokens(results: list[dict], what: str = "tokens") -> dict[int, list]:
    return {i: t for r in results for i, t in r[what].items()}


@pytest.mark.slow
def test_eplb_on_off_and_rebalanced_give_the_single_process_tokens(v4_checkpoint, clean_env):
    example = _example()
    disabled = example.feature_tables(example.parse_args(["--disable_eplb"]))
    assert disabled == {"eplb": {"enabled": False}}
    single = _tokens(_run(v4_checkpoint, ParallelLayout(), None))
    off = _run(v4_checkpoint, ParallelLayout(ep=2, dp=2), disabled)
    # re-placed after every forward pass, with replicas: weights move between the ranks mid-run
    on = _run(v4_checkpoint, ParallelLayout(ep=2, dp=2), {"eplb": {"num_extra_experts": 6, "rebalance_interval": 1}})
    assert _tokens(off) == single and _tokens(on) == single
    assert all(len(t) == 6 for t in single.values())
    E = json.loads((Path(v4_checkpoint) / "config.json").read_text())["n_routed_experts"]
    # --disable_eplb: one slot per expert, where expert parallelism puts it, never moved
    assert off[0]["rebalances"] is None and all(s == tuple(range(E)) for s in off[0]["slots"])
    assert on[0]["slots"] == on[1]["slots"]  # every rank installed the same placements
    assert on[0]["rebalances"] > 1
    for slots in on[0]["slots"]:
        counts = ExpertPlacement(num_experts=E, ep_size=2, slots=slots).replica_counts()
        assert len(slots) == physical_slots(E, 6, 2) and min(counts) == 1 and max(counts) > 1
    assert any(slots != on[0]["slots"][0] for slots in on[0]["slots"][1:])  # placed from each layer's own load


@pytest.mark.slow
def test_each_ep_group_balances_its_own_load(v4_checkpoint, clean_env):
    """--ep 2 --dp 4: EP groups [0, 1] and [2, 3] count the rows of their own exchanges and place
    their experts from them (re-placed every pass); tokens as on one process."""
    single = _tokens(_run(v4_checkpoint, ParallelLayout(), None))
    on = _run(v4_checkpoint, ParallelLayout(ep=2, dp=4), {"eplb": {"num_extra_experts": 6, "rebalance_interval": 1}})
    assert _tokens(on) == single
    for first in (0, 2):  # within a group: the same counts and the same placements on both ranks
        assert on[first]["load"] == on[first + 1]["load"] and on[first]["slots"] == on[first + 1]["slots"]
        assert on[first]["rebalances"] > 1
    assert on[0]["load"] != on[2]["load"]  # each group saw only its own ranks' prompts
    assert on[0]["slots"] != on[2]["slots"]  # ... and placed its experts from that


@pytest.mark.slow
def test_eplb_rebalanced_gives_the_single_process_tokens_v41(tiny_v41, clean_env):
    checkpoint = str(tiny_v41)
    single = _run(checkpoint, ParallelLayout(), None)
    on = _run(checkpoint, ParallelLayout(ep=2, dp=2), {"eplb": {"num_extra_experts": 3, "rebalance_interval": 1}})
    assert _tokens(on) == _tokens(single) and on[0]["rebalances"] > 1
    assert len(on[0]["slots"][0]) == 12  # 8 experts + 3, rounded up to a multiple of 2


@pytest.mark.slow
def test_under_batch_invariant_kernels_eplb_gives_the_same_logprob_bits(v4_checkpoint, clean_env):
    """Where an expert's output does not depend on how many rows it gets, replicas change nothing at all."""
    invariant = {"batch_invariant": {}}
    single = _run(v4_checkpoint, ParallelLayout(), invariant)
    on = _run(v4_checkpoint, ParallelLayout(ep=2, dp=2),
              {**invariant, "eplb": {"num_extra_experts": 6, "rebalance_interval": 1}})
    assert on[0]["rebalances"] > 1
    assert _tokens(on) == _tokens(single)
    assert _tokens(on, "logprobs") == _tokens(single, "logprobs")  # float equality: the same bits


def test_with_one_rank_eplb_does_nothing_and_says_so(v4_checkpoint, clean_env, caplog):
    from deepinfer import LLM

    with caplog.at_level(logging.INFO, logger="deepinfer"):
        llm = LLM(model=v4_checkpoint, accelerator="cpu", dtype="float32", max_num_seqs=2, cache_memory_gb=0.05,
                  features={"eplb": {}})
    try:
        assert llm.engine.features.pm.get_plugin("eplb").active is False
        assert "eplb: expert parallelism is off (ep=1), so there is nothing to balance" in caplog.text
    finally:
        llm.shutdown()
