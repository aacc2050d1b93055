"""DSpark speculative decoding, the parts that need no model: the rejection-sampling kernel and its
distribution preservation (chi-square), greedy acceptance, the verify-cost model and the
variable-length schedule, statistics, the feature's config and declaration."""
from __future__ import annotations

import pytest
import torch

from deepinfer.engine.sampler import Sampler, SamplingMetadata
from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.engine.speculative import Speculation, SpeculativeDecoder
from deepinfer.engine.verification import VerifyGroup, greedy_accept_count, verify
from deepinfer_plugins.cpu import CpuAccelerator
from deepinfer_plugins.features.dspark.config import DSparkConfig
from deepinfer_plugins.features.dspark.verify_scheduler import (ConfidenceCalibrator, VariableLengthPolicy,
                                                                 VerifyCostModel, plan_verification,
                                                                 profile_verify_cost)

ACC = CpuAccelerator()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square goodness of fit; 0 when a token of zero probability occurs."""
    n = counts.sum()
    expected = probs * n
    support = probs > 0
    if int(counts[~support].sum()):
        return 0.0
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


def _rows(seed: int, n: int, vocab: int, zero: list[int] | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, vocab, generator=g) + 0.05
    if zero:
        p[:, zero] = 0.0  # masked tokens (grammar, top-k)
    return p / p.sum(-1, keepdim=True)


def _run_trials(p: torch.Tensor, q: torch.Tensor | None, trials: int, seed: int, greedy_drafts: bool = False):
    """`trials` independent requests verifying m = len(q) drafts drawn from q against p."""
    m = p.shape[0] - 1
    g = torch.Generator().manual_seed(seed)
    if greedy_drafts:
        drafts = q.argmax(-1).repeat(trials)
    else:
        drafts = torch.stack([torch.multinomial(q, 1, replacement=True, generator=g).squeeze(1)
                              for _ in range(trials)]).reshape(-1)
    torch.manual_seed(seed)  # the kernel's draws use the global generator for unseeded requests
    out = ACC.rejection_sample(p.repeat(trials, 1), None if greedy_drafts else q.repeat(trials, 1), drafts,
                               [m] * trials, [None] * trials)
    return out


# --------------------------------------------------------------------------- rejection sampling


@pytest.mark.parametrize("greedy_drafts", [False, True])
@pytest.mark.slow
def test_rejection_sampling_preserves_the_target_distribution(greedy_drafts):
    vocab, m, trials = 6, 3, 12000
    p = _rows(1, m + 1, vocab, zero=[5])  # token 5 is masked by the target
    q = _rows(2, m, vocab)  # the drafter proposes it anyway
    out = _run_trials(p, q, trials, seed=3, greedy_drafts=greedy_drafts)
    emitted = (out >= 0).sum(1)
    assert not bool((out == 5).any()), "a masked token was emitted"
    assert int(emitted.min()) >= 1 and int(emitted.max()) <= m + 1
    tested = 0
    for pos in range(m + 1):  # reaching a position never biases what is emitted there
        reached = out[emitted > pos, pos]
        if len(reached) < 300:
            continue  # too few trials get this far (fixed greedy drafts are accepted with p(d) only)
        counts = torch.bincount(reached, minlength=vocab).double()
        assert chi_square_p(counts, p[pos].double()) > 1e-3, f"position {pos} is not distributed as p"
        tested += 1
    assert tested >= 2


def test_chi_square_check_detects_a_five_percent_bias():
    """The same number of trials rejects a distribution that moved 5% of the mass."""
    vocab, trials = 6, 12000
    p = _rows(1, 1, vocab, zero=[5])[0].double()
    biased = p.clone()
    biased[0] += 0.05
    biased[1] -= 0.05
    g = torch.Generator().manual_seed(0)
    sample = torch.multinomial(biased.float(), trials, replacement=True, generator=g)
    assert chi_square_p(torch.bincount(sample, minlength=vocab).double(), p) < 1e-6
    # and the classic mistake, accepting every draft, is caught too
    q = _rows(2, 1, vocab)
    drafts = torch.multinomial(q[0], trials, replacement=True, generator=g)
    assert chi_square_p(torch.bincount(drafts, minlength=vocab).double(), p) < 1e-6


def test_identical_distributions_accept_everything_and_add_a_bonus():
    p = _rows(4, 4, 10)
    out = _run_trials(p, p[:3].clone(), 200, seed=1)
    assert bool((out >= 0).all())  # p == q: every draft passes, then the bonus token


def test_one_hot_target_is_exact_match():
    """A greedy target (one-hot p) accepts a draft exactly when it is the argmax."""
    vocab = 8
    target = torch.zeros(4, vocab)
    target[torch.arange(4), torch.tensor([3, 1, 4, 1])] = 1.0
    drafts = torch.tensor([3, 1, 5])
    q = _rows(0, 3, vocab)
    out = ACC.rejection_sample(target, q, drafts, [3], [None])
    assert out.tolist() == [[3, 1, 4, -1]]  # two accepted, the third replaced by the target's token
    out = ACC.rejection_sample(target, None, torch.tensor([3, 1, 4]), [3], [None])
    assert out.tolist() == [[3, 1, 4, 1]]  # all accepted plus the bonus token


def test_seeded_requests_are_reproducible_and_independent_of_the_batch():
    vocab = 50
    p = _rows(5, 7, vocab)  # two requests: 2 drafts (3 rows) and 3 drafts (4 rows)
    q = _rows(6, 5, vocab)
    drafts = torch.tensor([1, 2, 3, 4, 5])

    def run(seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return ACC.rejection_sample(p, q, drafts, [2, 3], gens).tolist()

    a = run([7, 8])
    assert run([7, 8]) == a
    alone = ACC.rejection_sample(p[:3], q[:2], drafts[:2], [2], [torch.Generator().manual_seed(7)]).tolist()
    assert alone[0] == a[0][:3]
    assert run([7, 99])[0] == a[0]


def test_dead_position_emits_nothing_and_bad_shapes_are_refused():
    p = torch.zeros(2, 5)
    p[0, 2] = 1.0  # row 1 has no mass: every token masked after the accepted draft
    out = ACC.rejection_sample(p, None, torch.tensor([2]), [1], [None])
    assert out.tolist() == [[2, -1]]
    with pytest.raises(ValueError, match="need 3 target rows"):
        ACC.rejection_sample(torch.ones(2, 5) / 5, None, torch.tensor([1]), [1, 0], [None, None])
    with pytest.raises(ValueError, match="one per request"):
        ACC.rejection_sample(torch.ones(2, 5) / 5, None, torch.tensor([1]), [1], [])


def test_cpu_declares_rejection_sampling():
    assert ACC.capabilities().rejection_sampling


def test_greedy_accept_count():
    assert greedy_accept_count([5, 6, 7], [5, 6, 9]) == 2
    assert greedy_accept_count([5, 6, 7], [4, 6, 7]) == 0
    assert greedy_accept_count([5, 6], [5, 6]) == 2
    assert greedy_accept_count([], []) == 0


def _meta(temperatures: list[float]) -> SamplingMetadata:
    n = len(temperatures)
    return SamplingMetadata(temperature=temperatures, top_k=[0] * n, top_p=[1.0] * n, min_p=[0.0] * n,
                            seeds=[None] * n, num_logprobs=[None] * n)


def test_verify_greedy_rows_by_exact_match_with_a_bonus_and_dead_rows():
    """Two greedy requests in one batch: the first's drafts all match (bonus token after them), the
    second's second draft differs (the target's token replaces it, later rows carry -1); a row the
    bitmask empties is dead."""
    vocab = 8
    logits = torch.full((6, vocab), -5.0)
    logits[torch.arange(6), torch.tensor([3, 4, 5, 1, 2, 6])] = 5.0  # row argmaxes
    groups = [VerifyGroup(0, [3, 4], None, True, None), VerifyGroup(3, [1, 7], None, True, None)]
    sampler = Sampler(ACC, generator=torch.Generator().manual_seed(0))
    out = verify(logits, _meta([0.0] * 6), None, groups, sampler, ACC)
    assert out.token_ids.tolist() == [3, 4, 5, 1, 2, -1] and not out.dead.any()
    mask = torch.full((6, 1), -1, dtype=torch.int32)
    mask[4] = 0  # nothing allowed after the second request's first draft
    out = verify(logits, _meta([0.0] * 6), mask, groups, sampler, ACC)
    assert out.token_ids.tolist()[3:] == [1, -1, -1] and out.dead.tolist()[3:] == [False, True, False]


@pytest.mark.parametrize("greedy", [True, False], ids=["exact-match", "rejection"])
def test_verify_stops_at_a_non_finite_row(greedy):
    """Request 0's drafts all pass the target but its second row is NaN: it emits the first draft
    and is flagged at row 1 (its later rows emit nothing). Request 1 has a broken row after a
    rejected draft, which is never consulted: it emits as usual and is not flagged."""
    vocab = 4
    logits = torch.full((6, vocab), -30.0)
    logits[torch.arange(6), torch.tensor([2, 3, 1, 0, 2, 3])] = 30.0  # the target's token at every row
    logits[1, 0] = float("nan")
    logits[5, 1] = float("nan")
    q = None if greedy else torch.full((2, vocab), 0.25)
    groups = [VerifyGroup(0, [2, 3], q, greedy, 5), VerifyGroup(3, [0, 1], q, greedy, 6)]
    sampler = Sampler(ACC, generator=torch.Generator().manual_seed(0))
    out = verify(logits, _meta([0.0 if greedy else 1.0] * 6), None, groups, sampler, ACC)
    assert out.token_ids.tolist() == [2, -1, -1, 0, 2, -1]
    assert out.nonfinite.tolist() == [False, True, False, False, False, False]
    assert not out.dead.any() and torch.isfinite(out.logprobs).all()


def test_verify_rejection_samples_non_greedy_rows():
    vocab = 4
    logits = torch.zeros(3, vocab)
    logits[:, 2] = 50.0  # the target puts all its mass on token 2 at every position
    drafts = [2, 0]
    q = torch.full((2, vocab), 0.25)
    sampler = Sampler(ACC, generator=torch.Generator().manual_seed(0))
    group = VerifyGroup(0, drafts, q, greedy=False, seed=123)
    out = verify(logits, _meta([1.0] * 3), None, [group], sampler, ACC)
    assert out.token_ids.tolist() == [2, 2, -1]  # draft 2 passes, draft 0 has p = 0: replaced by 2


class _Drafter:
    features = None
    context_window = 0

    def propose(self, requests, features):
        return [None] * len(requests)

    def forget(self, request_id):
        pass


def test_the_core_refuses_a_contribution_that_is_not_a_speculation():
    with pytest.raises(TypeError, match="must be a Speculation"):
        SpeculativeDecoder(object(), sampler=None, accelerator=ACC, max_model_len=64)
    with pytest.raises(TypeError, match="must be a Speculation"):
        SpeculativeDecoder(Speculation(drafter=object(), num_draft_tokens=2), sampler=None, accelerator=ACC,
                           max_model_len=64)
    spec = SpeculativeDecoder(Speculation(_Drafter(), 3), sampler=None, accelerator=ACC, max_model_len=64)
    assert spec.plan([[0.5]]) is None and spec.draft_limit(None) == 3 and spec.draft_limit(1) == 2


def test_the_dspark_speculator_is_a_speculation_with_the_variable_length_policy():
    from deepinfer_plugins.features.dspark.speculator import Speculator

    cost = _linear_cost(per_step=1.0, per_token=0.001)
    fixed = Speculator(_Drafter(), DSparkConfig(num_draft_tokens=3))
    assert isinstance(fixed, Speculation) and fixed.policy is None and fixed.num_draft_tokens == 3
    varlen = Speculator(_Drafter(), DSparkConfig(num_draft_tokens=3, variable_length=True), cost_model=cost)
    assert isinstance(varlen.policy, VariableLengthPolicy) and varlen.policy.cost_model is cost
    with pytest.raises(ValueError, match="verify-cost table"):
        Speculator(_Drafter(), DSparkConfig(variable_length=True))


def test_variable_length_policy_explores_then_follows_the_evidence():
    steep = _linear_cost(per_step=0.01, per_token=1.0)  # a token costs a whole step: verify nothing unsure
    policy = VariableLengthPolicy(steep, num_draft_tokens=3)
    policy.calibrator.min_observations = 4
    assert policy.plan([[0.05, 0.05, 0.05]], draft_seconds=0.0) == [1]  # no evidence yet: one exploratory draft
    for _ in range(10):
        policy.observe([0.05, 0.05, 0.05], num_verified=1, num_accepted=0)
    assert policy.plan([[0.05, 0.05, 0.05]], draft_seconds=0.0) == [0]  # always rejected: none


# --------------------------------------------------------------------- variable-length verification


def _linear_cost(per_step: float, per_token: float) -> VerifyCostModel:
    return VerifyCostModel({b: [(b, per_step + per_token * b), (6 * b, per_step + per_token * 6 * b)]
                            for b in (1, 4, 32)})


def test_cost_model_interpolates_between_profiled_points():
    cost = VerifyCostModel({1: [(1, 1.0), (6, 2.0)], 4: [(4, 2.0), (24, 6.0)]})
    assert cost.cost(1, 1) == pytest.approx(1.0)
    assert cost.cost(1, 3.5) == pytest.approx(1.5)
    assert cost.cost(1, 11) == pytest.approx(3.0)  # extrapolated with the last slope
    assert cost.cost(4, 14) == pytest.approx(4.0)
    assert cost.cost(2, 4) == pytest.approx(0.5 * cost.cost(1, 4) + 0.5 * cost.cost(4, 4))  # halfway in log2(B)
    assert cost.cost(64, 24) == pytest.approx(6.0)
    with pytest.raises(ValueError):
        VerifyCostModel({})


def test_high_confidence_verifies_every_draft_and_low_confidence_none():
    flat = _linear_cost(per_step=1.0, per_token=0.001)  # memory bound: extra tokens almost free
    assert plan_verification([[0.9] * 5, [0.8] * 5], flat) == [5, 5]
    steep = _linear_cost(per_step=0.01, per_token=1.0)  # compute bound: a token costs a whole step
    assert plan_verification([[0.05] * 5, [0.1] * 5], steep) == [0, 0]


def test_schedule_trims_low_confidence_tails_first():
    cost = _linear_cost(per_step=1.0, per_token=0.1)
    chosen = plan_verification([[0.95, 0.9, 0.2, 0.9, 0.9], [0.3, 0.9, 0.9, 0.9, 0.9], [0.9] * 5], cost)
    assert chosen[0] == 2  # its prefix survival collapses at the third draft
    assert chosen[1] <= 1  # a doubtful first draft: little or nothing of it
    assert chosen[2] >= 3
    assert all(0 <= c <= 5 for c in chosen)
    # with the same drafts, a more expensive step per token verifies no more
    dearer = plan_verification([[0.95, 0.9, 0.2, 0.9, 0.9], [0.3] + [0.9] * 4, [0.9] * 5], _linear_cost(1.0, 0.5))
    assert all(d <= c for d, c in zip(dearer, chosen)) and sum(dearer) < sum(chosen)
    assert plan_verification([], cost) == []


def test_calibration_learns_the_observed_acceptance_and_asks_for_evidence():
    cal = ConfidenceCalibrator(num_positions=3, prior_weight=8.0, min_observations=4)
    assert cal.calibrate(0, 0.05) == pytest.approx(0.05)  # no evidence: the raw confidence
    assert cal.needs_evidence(0, 0.05)
    for _ in range(40):  # a drafter whose unsure-looking drafts are always accepted
        cal.observe([0.05, 0.06, 0.5], num_verified=2, num_accepted=2)
    assert cal.calibrate(0, 0.05) > 0.8 and cal.calibrate(1, 0.06) > 0.8
    assert not cal.needs_evidence(0, 0.05) and cal.needs_evidence(2, 0.5)  # draft 2 was never verified
    assert cal.calibrate(2, 0.5) == pytest.approx(0.5)
    for _ in range(40):  # a confident drafter that is always wrong
        cal.observe([0.9, 0.9, 0.9], num_verified=3, num_accepted=0)
    assert cal.calibrate(0, 0.9) < 0.2
    assert cal.calibrate(1, 0.9) == pytest.approx(0.9)  # never reached: a rejection ends the verification


def test_profile_times_each_batch_and_query_length():
    calls = []
    cost = profile_verify_cost(lambda b, q: calls.append((b, q)), max_batch=20, max_query=6, max_tokens=30, repeats=2)
    assert sorted(cost.table) == [1, 4, 16, 20]
    assert [t for t, _ in cost.table[1]] == [1, 6] and [t for t, _ in cost.table[4]] == [4, 24]
    assert [t for t, _ in cost.table[16]] == [16]  # 16 x 6 tokens exceed the step budget
    assert calls[0] == (4, 6) and len(calls) == 1 + 2 * sum(len(v) for v in cost.table.values())  # warm-up first
    for points in cost.table.values():
        assert all(s1 >= s0 for (_, s0), (_, s1) in zip(points, points[1:]))


# ------------------------------------------------------------------------------- stats and config


def test_stats_accumulate_acceptance_by_position():
    s = SpecDecodeStats(num_draft_tokens=3)
    s.record_step([(3, 3), (3, 1)])
    s.record_step([(2, 0)])
    s.record_step([])
    assert (s.num_steps, s.num_verifications, s.num_drafts_verified, s.num_drafts_accepted) == (2, 3, 8, 4)
    assert s.num_tokens_emitted == 7 and s.mean_accepted_length == pytest.approx(7 / 3)
    assert s.accept_rate == pytest.approx(0.5) and s.mean_verified_drafts == pytest.approx(8 / 3)
    assert s.verified_drafts_per_step == pytest.approx(4.0)
    assert s.acceptance_by_position == [pytest.approx(2 / 3), pytest.approx(1 / 3), pytest.approx(0.5)]
    assert s.as_dict()["mean_accepted_length"] == pytest.approx(7 / 3)


def test_config_defaults_env_vars_and_zero_disables(clean_env):
    from deepinfer.config import load_config, resolve_feature_configs

    c = DSparkConfig()
    assert (c.num_draft_tokens, c.variable_length, c.drafter, c.enabled, c.max_rollback) == (5, False, "mtp", True, 6)
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    clean_env.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    got = resolve_feature_configs(load_config(), {"dspark": DSparkConfig})["dspark"]
    assert got.num_draft_tokens == 3 and got.variable_length and got.max_rollback == 4
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    assert not resolve_feature_configs(load_config(), {"dspark": DSparkConfig})["dspark"].enabled
    with pytest.raises(ValueError, match="num_draft_tokens"):
        DSparkConfig(num_draft_tokens=-1)
    with pytest.raises(ValueError, match="drafter"):
        DSparkConfig(drafter="ngram")


def test_fixed_length_verification_alone_does_not_turn_speculation_on(clean_env):
    """DEEPINFER_ENABLE_MTP_VARLEN=0 chooses fixed-length verification for speculation that is on for
    other reasons (a table, DEEPINFER_USE_NEXTN_DECODE); on its own it turns nothing on. =1 asks for
    confidence-scheduled verification, which needs speculation, so it does turn it on."""
    from deepinfer.config import load_config, resolve_feature_configs

    models = {"dspark": DSparkConfig}
    clean_env.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    assert resolve_feature_configs(load_config(), models) == {}
    table = load_config({"features": {"dspark": {"num_draft_tokens": 2}}})
    assert resolve_feature_configs(table, models)["dspark"] == DSparkConfig(num_draft_tokens=2, variable_length=False)
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "4")
    assert resolve_feature_configs(load_config(), models)["dspark"] == DSparkConfig(num_draft_tokens=4)
    clean_env.delenv("DEEPINFER_USE_NEXTN_DECODE")
    clean_env.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    assert resolve_feature_configs(load_config(), models)["dspark"].variable_length


def test_feature_is_installed_and_declares_the_draft_proposer_slot():
    from deepinfer.plugins import feature_specs

    plugins, errors = feature_specs()
    assert "dspark" in plugins and "dspark" not in errors
    plugin, spec = plugins["dspark"]
    assert spec.slots == ("draft_proposer",) and spec.config_model is DSparkConfig
    assert "rejection_sampling" in spec.required_capabilities and not spec.enabled_by_default
    assert all(hasattr(plugin, h) for h in spec.hooks)


def test_feature_is_dropped_when_zero_drafts_and_refused_without_the_capability(clean_env):
    from deepinfer.config import load_config
    from deepinfer.plugins import PluginError, load_features

    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    assert "dspark" not in load_features(load_config(), ACC).specs

    class NoRejection(CpuAccelerator):
        def capabilities(self):
            return super().capabilities().model_copy(update={"rejection_sampling": False})

    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    with pytest.raises(PluginError, match="rejection_sampling"):
        load_features(load_config(), NoRejection())
