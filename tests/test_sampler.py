import pytest
import torch

from deepinfer.engine.sampler import Sampler, SamplingMetadata, nonfinite_problem, position_seed
from deepinfer_plugins.cpu import CpuAccelerator

V = 50


@pytest.fixture(scope="module")
def sampler():
    g = torch.Generator()
    g.manual_seed(0)
    return Sampler(CpuAccelerator(), generator=g)


def meta(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, logprobs=None, banned=()):
    return SamplingMetadata(temperature=[temperature] * n, top_k=[top_k] * n, top_p=[top_p] * n, min_p=[min_p] * n,
                            seeds=list(seeds) if seeds is not None else [None] * n,
                            num_logprobs=[logprobs] * n, banned=list(banned))


def logits(rows=1, seed=1):
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 2


def draws(sampler, x, n=300, **kw):
    """Tokens from `n` independent seeded draws of one row."""
    return [int(sampler(x, meta(1, seeds=[position_seed(s, 0)], **kw)).token_ids[0]) for s in range(n)]


def test_greedy_is_argmax(sampler):
    x = logits(4)
    out = sampler(x, meta(4, temperature=0.0))
    assert out.token_ids.tolist() == x.argmax(-1).tolist()
    assert out.ranks is None and not out.dead.any()  # ranks only when a row asks for logprobs
    torch.testing.assert_close(out.logprobs, torch.log_softmax(x, -1).max(-1).values)
    ranked = sampler(x, meta(4, temperature=0.0, logprobs=0))
    assert ranked.ranks.tolist() == [1, 1, 1, 1] and ranked.top_ids is None


def test_greedy_fast_path_matches_the_general_path(sampler):
    # all-greedy unconstrained rows take argmax_logsumexp; a banned entry that bans nothing takes the
    # general path (masks, max, logsumexp): the same tokens and log-probabilities
    x = logits(3)
    x[1, [4, 40]] = 30.0  # a tie
    fast = sampler(x, meta(3, temperature=0.0))
    general = sampler(x, meta(3, temperature=0.0, banned=[(0, [])]))
    assert fast.token_ids.tolist() == general.token_ids.tolist() == x.argmax(-1).tolist()
    torch.testing.assert_close(fast.logprobs, general.logprobs)
    assert not fast.dead.any() and not general.dead.any()


def test_greedy_ties_take_the_first_index(sampler):
    x = torch.zeros(2, V)
    x[0, [7, 3, 9]] = 5.0
    x[1, [V - 1, 11]] = 2.0
    assert sampler(x, meta(2, temperature=0.0)).token_ids.tolist() == [3, 11]
    mixed = meta(2, temperature=0.0)
    mixed.temperature[1] = 1.0  # one greedy row among sampled ones takes the other path
    assert sampler(x, mixed).token_ids.tolist()[0] == 3


def test_top_k_1_is_greedy(sampler):
    x = logits(3)
    assert sampler(x, meta(3, top_k=1)).token_ids.tolist() == x.argmax(-1).tolist()


def test_top_k_restricts_the_candidates(sampler):
    x = logits()
    allowed = set(x[0].topk(3).indices.tolist())
    seen = set(draws(sampler, x, top_k=3))
    assert seen <= allowed and len(seen) > 1


def test_top_p_keeps_the_smallest_prefix_reaching_p(sampler):
    x = torch.full((1, V), -20.0)
    x[0, [3, 7, 9]] = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    assert set(draws(sampler, x, top_p=0.75)) == {3, 7}  # 0.5 < 0.75 <= 0.8
    assert set(draws(sampler, x, top_p=0.5)) == {3}


def test_min_p_drops_unlikely_tokens(sampler):
    x = torch.full((1, V), -20.0)
    x[0, [3, 7, 9]] = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    assert set(draws(sampler, x, min_p=0.5)) == {3, 7}  # 0.2 < 0.5 * 0.5


def test_force_topk_restricts_before_sampling():
    s = Sampler(CpuAccelerator(), force_topk=2)
    x = logits()
    assert set(draws(s, x, n=200)) <= set(x[0].topk(2).indices.tolist())


def test_temperature_spreads_and_sharpens(sampler):
    x = logits()
    hot = set(draws(sampler, x, temperature=5.0))
    cold = set(draws(sampler, x, temperature=0.05))
    assert len(hot) > 10 and cold == {int(x.argmax())}


def test_seq_seed_draw_does_not_depend_on_the_batch(sampler):
    x = logits(6, seed=3)
    seeds = [position_seed(42, i) for i in range(6)]
    alone = [int(sampler(x[i:i + 1], meta(1, seeds=[seeds[i]])).token_ids[0]) for i in range(6)]
    batched = sampler(x, meta(6, seeds=seeds)).token_ids.tolist()
    reordered = sampler(x.flip(0), meta(6, seeds=seeds[::-1])).token_ids.flip(0).tolist()
    assert alone == batched == reordered
    # with top-p on one neighbour only (a different code path), the others are unchanged
    m = meta(6, seeds=seeds)
    m.top_p[0] = 0.5
    assert sampler(x, m).token_ids.tolist()[1:] == alone[1:]


def test_position_seed_mixes():
    seeds = {position_seed(s, i) for s in range(20) for i in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**64 for s in seeds)


def test_bitmask_and_banned_tokens(sampler):
    x = logits(2)
    mask = torch.zeros(2, (V + 31) // 32, dtype=torch.int32)
    mask[0, 0] = 1 << 5  # row 0: only token 5
    mask[1] = -1  # row 1: everything
    out = sampler(x, meta(2, temperature=0.0), mask)
    assert out.token_ids[0] == 5 and out.token_ids[1] == x[1].argmax()
    top = int(x[0].argmax())
    out = sampler(x[:1], meta(1, temperature=0.0, banned=[(0, [top])]))
    assert int(out.token_ids[0]) == int(x[0].topk(2).indices[1])


def test_all_masked_row_is_dead_not_nan(sampler):
    x = logits(2)
    mask = torch.full((2, (V + 31) // 32), -1, dtype=torch.int32)
    mask[1] = 0
    for temperature in (0.0, 1.0):
        out = sampler(x, meta(2, temperature=temperature, top_p=0.9), mask)
        assert out.dead.tolist() == [False, True]
        assert out.token_ids[1] == -1 and out.logprobs[1] == 0.0 and not torch.isnan(out.logprobs).any()


def _broken(x):
    """Rows 1-3 of `x` broken (one NaN, one +inf, every logit -inf); rows 0 and 4 fine, row 4 with
    -inf logits for some tokens (a model may ban tokens itself)."""
    x = x.clone()
    x[1, 3] = float("nan")
    x[2, 7] = float("inf")
    x[3] = float("-inf")
    x[4, :10] = float("-inf")
    return x


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.0, logprobs=2), dict(temperature=1.0),
                                dict(temperature=0.8, top_p=0.9, seeds=[7, 8, 9, 10, 11]),
                                dict(temperature=0.0, banned=[(0, [1])])],
                         ids=["greedy", "greedy-logprobs", "plain", "top-p-seeded", "banned"])
def test_non_finite_rows_sample_nothing_and_the_others_are_unchanged(sampler, kw):
    x = logits(5)
    out = sampler(_broken(x), meta(5, **kw))
    assert out.nonfinite.tolist() == [False, True, True, True, False]
    assert out.token_ids.tolist()[1:4] == [-1, -1, -1] and not out.dead.any()
    assert torch.isfinite(out.logprobs).all() and out.logprobs[1:4].tolist() == [0.0, 0.0, 0.0]
    fine = sampler(_broken(x)[[0, 4]], meta(2, **{**kw, "seeds": [7, 11]}) if "seeds" in kw else meta(2, **kw))
    if kw["temperature"] == 0.0 or "seeds" in kw:  # deterministic rows: as without the broken rows
        assert out.token_ids[[0, 4]].tolist() == fine.token_ids.tolist()
        torch.testing.assert_close(out.logprobs[[0, 4]], fine.logprobs)
    assert int(out.token_ids[4]) >= 10  # a token the model banned (-inf) is never drawn


def test_a_broken_row_under_a_mask_is_non_finite_not_a_dead_end(sampler):
    x = _broken(logits(5))
    mask = torch.full((5, (V + 31) // 32), -1, dtype=torch.int32)
    mask[0] = 0  # row 0 (finite): nothing allowed
    for temperature in (0.0, 1.0):
        out = sampler(x, meta(5, temperature=temperature), mask)
        assert out.dead.tolist() == [True, False, False, False, False]
        assert out.nonfinite.tolist() == [False, True, True, True, False]


def test_nonfinite_problem_says_what_was_wrong():
    x = _broken(logits(5))
    assert "output token 4 are not finite (1 NaN among 50 logits)" in nonfinite_problem(x[1], 4)
    assert "(1 +inf among 50 logits)" in nonfinite_problem(x[2], 0)
    assert "(all 50 logits are -inf)" in nonfinite_problem(x[3], 0)


def test_logprobs_come_from_the_raw_distribution(sampler):
    x = logits(2)
    out = sampler(x, meta(2, temperature=0.0, logprobs=3))
    raw = torch.log_softmax(x, -1)
    torch.testing.assert_close(out.top_logprobs, raw.topk(3).values)
    assert out.top_ids.tolist() == raw.topk(3).indices.tolist()
