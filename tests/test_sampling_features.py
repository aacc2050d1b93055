"""The engine's OpenAI / vLLM sampling fields: penalties and logit bias, prompt log-probabilities
(echo, `max_tokens=0`), and several samples of one prompt (`n`, `best_of`) forked from one prefill.

Most checks run on the toy engine (tests/engine_helpers.py), whose logits depend on the whole
token history kept in the engine's cache: a penalty counted over the wrong tokens, a prompt
position scored against the wrong logits, or a fork that copies the wrong state changes the
result. The fork is also checked on tiny DeepSeek-V4 and V4.1 checkpoints (their window rings,
compressor rows and compressed blocks), with the batch-invariant kernels so that a sample and an
independent request see the same logits bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch

from deepinfer.engine.sampler import LogitAdjustment
from deepinfer.sampling_params import SamplingParams
from engine_helpers import TOY_VOCAB, ToyModel, run_all, toy_engine

PROMPTS = [[5, 9, 13, 2, 40], [7, 7, 30], [12, 50, 3, 3, 8, 21, 33, 44, 9], [60, 2]]


# -- SamplingParams ------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, words", [
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -3, "[-2, 2]"),
    ("frequency_penalty", float("nan"), "[-2, 2]"),
    ("repetition_penalty", 0, "> 0"),
    ("logit_bias", {5: 101}, "[-100, 100]"),
    ("logit_bias", {-1: 1}, "non-negative"),
    ("logit_bias", [1, 2], "map"),
    ("n", 0, ">= 1"),
    ("best_of", 1, ">= n=2"),
    ("prompt_logprobs", -1, ">= 0"),
    ("max_tokens", 0, "needs prompt_logprobs"),
])
def test_new_fields_are_checked(field, value, words):
    kw = {"n": 2} if field == "best_of" else {}
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value}, **kw)
    assert f"SamplingParams.{field}" in str(err.value) and words in str(err.value)


def test_max_tokens_0_scores_one_sample_only():
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).num_samples == 1
    with pytest.raises(ValueError, match="leave n and best_of at 1"):
        SamplingParams(max_tokens=0, prompt_logprobs=0, n=2)
    assert SamplingParams(n=2, best_of=5).num_samples == 5 and SamplingParams(n=3).num_samples == 3


def test_out_of_vocabulary_bias_fails_that_request_alone():
    engine = toy_engine()
    bad, good = run_all(engine, [[5, 6], [5, 6]], [SamplingParams(logit_bias={TOY_VOCAB: 5.0}, max_tokens=2),
                                                    SamplingParams(temperature=0, max_tokens=2)])
    assert bad.outputs[0].finish_reason == "error" and "logit_bias" in bad.error and str(TOY_VOCAB) in bad.error
    assert good.outputs[0].finish_reason == "length"


# -- penalties and logit bias --------------------------------------------------------------------------

def test_adjustment_follows_vllms_formulas():
    row = torch.tensor([2.0, -2.0, 1.0, 0.5, -1.0, 3.0])
    out = torch.tensor([0, 0, 3])  # token 0 twice, token 3 once
    prompt = torch.tensor([1, 4])
    a = LogitAdjustment(row=0, output_ids=out, prompt_ids=prompt, presence=0.5, frequency=0.25, repetition=2.0,
                        bias={5: -10.0, 2: 1.0})
    got = row.clone()
    a.apply(got)
    # bias first; repetition on prompt and output tokens (divide positive, multiply negative);
    # then frequency per occurrence and presence once, on output tokens only
    expected = torch.tensor([2.0 / 2 - 0.25 * 2 - 0.5, -2.0 * 2, 1.0 + 1.0, 0.5 / 2 - 0.25 - 0.5, -1.0 * 2, 3.0 - 10.0])
    torch.testing.assert_close(got, expected)


def _greedy_by_hand(engine_factory, prompt, steps, presence=0.0, frequency=0.0, extra_bias=None):
    """Greedy decoding where each step is a fresh one-token request over prompt + output so far,
    the penalties written as a logit bias: what the engine must produce for the penalised request."""
    out: list[int] = []
    for _ in range(steps):
        bias = dict(extra_bias or {})
        for t in set(out):
            bias[t] = bias.get(t, 0.0) - presence - frequency * out.count(t)
        engine = engine_factory()
        (res,) = run_all(engine, [prompt + out], [SamplingParams(temperature=0, max_tokens=1, logit_bias=bias or None)])
        out.append(res.outputs[0].token_ids[0])
    return out


@pytest.mark.parametrize("async_pipeline", [False, True])
def test_presence_and_frequency_penalties_count_the_generated_tokens(async_pipeline):
    def factory():
        return toy_engine(async_pipeline=async_pipeline, max_num_batched_tokens=4)  # prompts chunked
    params = [SamplingParams(temperature=0, max_tokens=10, presence_penalty=1.5, frequency_penalty=0.7),
              SamplingParams(temperature=0, max_tokens=10, presence_penalty=2.0, logit_bias={17: 1.0}),
              SamplingParams(temperature=0, max_tokens=10),
              SamplingParams(temperature=0, max_tokens=10, frequency_penalty=-2.0)]
    outs = run_all(factory(), PROMPTS, params)
    for prompt, p, o in zip(PROMPTS, params, outs):
        expected = _greedy_by_hand(factory, prompt, 10, p.presence_penalty, p.frequency_penalty, p.logit_bias)
        assert o.outputs[0].token_ids == expected
    plain = run_all(factory(), PROMPTS[:1], [SamplingParams(temperature=0, max_tokens=10)])[0].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids != plain  # the penalty changed something on this prompt


def test_logit_bias_forces_a_token_and_logprobs_stay_raw():
    engine = toy_engine()
    free, biased = run_all(engine, [[5, 6, 7]] * 2, [
        SamplingParams(temperature=0, max_tokens=3, logprobs=TOY_VOCAB),
        SamplingParams(temperature=0, max_tokens=3, logit_bias={42: 100.0}, logprobs=TOY_VOCAB)])
    assert biased.outputs[0].token_ids == [42, 42, 42] and free.outputs[0].token_ids[0] != 42
    # the reported log-probability is the model's, not the biased distribution's
    assert biased.outputs[0].logprobs[0][42].logprob == free.outputs[0].logprobs[0][42].logprob
    assert biased.outputs[0].logprobs[0][42].rank > 1


def test_repetition_penalty_reaches_prompt_tokens():
    # a prompt whose greedy next token is one of its own tokens: a strong repetition penalty moves off it
    engine = toy_engine()
    candidates = [[x, y, x] for x in range(2, 40) for y in range(2, 40)]
    frees = run_all(engine, candidates, [SamplingParams(temperature=0, max_tokens=1)] * len(candidates))
    prompt, free = next((c, o.outputs[0].token_ids[0]) for c, o in zip(candidates, frees)
                        if o.outputs[0].token_ids[0] in c)
    (again,) = run_all(toy_engine(), [prompt], [SamplingParams(temperature=0, max_tokens=1, repetition_penalty=50.0)])
    (mild,) = run_all(toy_engine(), [prompt], [SamplingParams(temperature=0, max_tokens=1, repetition_penalty=1.0)])
    assert free in prompt and again.outputs[0].token_ids[0] not in prompt and mild.outputs[0].token_ids[0] == free


def test_penalised_seeded_requests_are_batch_invariant_and_deterministic():
    params = [SamplingParams(temperature=0.9, max_tokens=8, seq_seed=11 + i, presence_penalty=0.8,
                             frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={3: 2.0}) for i in range(4)]
    batched = [o.outputs[0].token_ids for o in run_all(toy_engine(async_pipeline=True), PROMPTS, params)]
    alone = [run_all(toy_engine(), [p], [sp])[0].outputs[0].token_ids for p, sp in zip(PROMPTS, params)]
    tight = [o.outputs[0].token_ids for o in run_all(toy_engine(num_slots=2, num_blocks=6, max_num_seqs=2,
                                                                max_num_batched_tokens=3), PROMPTS, params)]
    assert batched == alone == tight


def test_the_greedy_fast_path_is_kept_without_adjustments(monkeypatch):
    from deepinfer.engine.sampler import Sampler

    calls = []
    original = Sampler._greedy
    monkeypatch.setattr(Sampler, "_greedy", lambda self, *a: calls.append(1) or original(self, *a))
    run_all(toy_engine(), [[5, 6]], [SamplingParams(temperature=0, max_tokens=3)])
    assert len(calls) == 3
    run_all(toy_engine(), [[5, 6]], [SamplingParams(temperature=0, max_tokens=3, presence_penalty=1.0)])
    assert len(calls) == 3  # a penalised row takes the general path


# -- prompt log-probabilities ----------------------------------------------------------------------------

def _reference_prompt_logprobs(prompt):
    """log p(prompt[k] | prompt[:k]) from one-token requests that return the whole distribution."""
    out = [None]
    for k in range(1, len(prompt)):
        (res,) = run_all(toy_engine(), [prompt[:k]], [SamplingParams(temperature=0, max_tokens=1,
                                                                      logprobs=TOY_VOCAB)])
        out.append(res.outputs[0].logprobs[0][prompt[k]].logprob)
    return out


@pytest.mark.parametrize("async_pipeline", [False, True])
def test_prompt_logprobs_score_every_prompt_token_across_chunks(async_pipeline):
    engine = toy_engine(async_pipeline=async_pipeline, max_num_batched_tokens=4)
    params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0),
              SamplingParams(temperature=0, max_tokens=3)]
    outs = run_all(engine, [PROMPTS[2], PROMPTS[0], PROMPTS[1]], params)
    scored, zero, plain = outs
    for o, prompt in ((scored, PROMPTS[2]), (zero, PROMPTS[0])):
        got = o.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        ref = _reference_prompt_logprobs(prompt)
        for k in range(1, len(prompt)):
            assert got[k][prompt[k]].logprob == pytest.approx(ref[k], abs=1e-6)
    for e, token in zip(scored.prompt_logprobs[1:], PROMPTS[2][1:]):  # the token, then the top 2
        assert token in e and {lp.rank for t, lp in e.items() if t != token} <= {1, 2} and len(e) in (2, 3)
    assert zero.outputs[0].token_ids == [] and zero.outputs[0].finish_reason == "length"
    assert scored.outputs[0].finish_reason == "length" and len(scored.outputs[0].token_ids) == 2
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_survive_preemption():
    # a pool of 5 blocks for 4 growing requests: preemptions; each prompt position is scored once
    engine = toy_engine(num_blocks=5, max_num_batched_tokens=5, async_pipeline=True)
    params = [SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=0, ignore_eos=True) for _ in PROMPTS]
    outs = run_all(engine, PROMPTS, params)
    assert engine.scheduler.num_preemptions > 0
    for prompt, o in zip(PROMPTS, outs):
        assert len(o.prompt_logprobs) == len(prompt)
        ref = _reference_prompt_logprobs(prompt)
        assert [e[t].logprob for e, t in zip(o.prompt_logprobs[1:], prompt[1:])] == pytest.approx(ref[1:], abs=1e-6)


# -- several samples of one prompt ----------------------------------------------------------------------

class CountingToy(ToyModel):
    """Counts the input tokens the model computed."""

    def __init__(self):
        super().__init__()
        self.tokens = 0

    def forward(self, batch):
        self.tokens += sum(batch.query_lens)
        return super().forward(batch)


@pytest.mark.parametrize("async_pipeline", [False, True])
def test_n_samples_equal_independent_seeded_requests_from_one_prefill(async_pipeline):
    prompt = PROMPTS[2]
    model = CountingToy()
    engine = toy_engine(model=model, async_pipeline=async_pipeline, num_slots=6, max_num_seqs=6)
    params = SamplingParams(temperature=1.0, max_tokens=6, seq_seed=40, n=3, ignore_eos=True, logprobs=1)
    (group,) = run_all(engine, [prompt], [params])
    assert [o.index for o in group.outputs] == [0, 1, 2]
    assert model.tokens == len(prompt) + 3 * (6 - 1)  # one prefill; each sample decodes its own tokens
    alone = [run_all(toy_engine(), [prompt], [params.clone(n=1, seq_seed=40 + i)])[0].outputs[0] for i in range(3)]
    for got, want in zip(group.outputs, alone):
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob)
        assert [set(e) for e in got.logprobs] == [set(e) for e in want.logprobs]
    assert len({tuple(o.token_ids) for o in group.outputs}) > 1
    assert group.metrics.num_output_tokens == 18 and group.finished
    assert engine.stats().slots_used == 0


def test_samples_that_do_not_fit_prefill_on_their_own_and_match():
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0.8, max_tokens=5, seq_seed=3, n=4, ignore_eos=True)
    model = CountingToy()
    engine = toy_engine(model=model, num_slots=2, max_num_seqs=2)  # only one sample can be forked
    (group,) = run_all(engine, [prompt], [params])
    assert len(prompt) + 4 * 4 < model.tokens  # the others prefilled on their own
    alone = [run_all(toy_engine(), [prompt], [params.clone(n=1, seq_seed=3 + i)])[0].outputs[0].token_ids
             for i in range(4)]
    assert [o.token_ids for o in group.outputs] == alone


def test_best_of_returns_the_samples_with_the_highest_mean_logprob():
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=1.5, max_tokens=4, seq_seed=9, n=2, best_of=5, ignore_eos=True)
    (out,) = run_all(toy_engine(num_slots=6, max_num_seqs=6), [prompt], [params])
    every = [run_all(toy_engine(), [prompt], [params.clone(n=1, best_of=None, seq_seed=9 + i)])[0].outputs[0]
             for i in range(5)]
    means = sorted((o.cumulative_logprob / len(o.token_ids), o.token_ids) for o in every)[::-1]
    assert [o.token_ids for o in out.outputs] == [t for _, t in means[:2]]
    assert [o.index for o in out.outputs] == [0, 1]
    assert out.metrics.num_output_tokens == 20


def test_aborting_a_request_of_several_samples_aborts_them_all():
    engine = toy_engine(num_slots=6, max_num_seqs=6)
    req = engine.add_request([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=50, n=3, ignore_eos=True),
                             request_id="g")
    engine.step()
    engine.step()
    engine.abort(["g"])
    while engine.has_unfinished():
        engine.step()
    out = req.to_output()
    assert [o.finish_reason for o in out.outputs] == ["abort"] * 3 and req.all_finished
    assert engine.stats().slots_used == 0 and not engine.scheduler.requests


def test_a_bad_request_of_several_samples_fails_alone_with_its_reason():
    engine = toy_engine()
    bad, good = run_all(engine, [[], [5]], [SamplingParams(n=2), SamplingParams(temperature=0, max_tokens=2)])
    assert bad.outputs[0].finish_reason == "error" and "empty" in bad.error
    assert good.outputs[0].finish_reason == "length"


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    from deepinfer.models.deepseek_v4.make_model import make_model as make_v4
    from deepinfer.models.deepseek_v41.make_model import make_model as make_v41

    root = tmp_path_factory.mktemp("samples")
    return {"v4": str(make_v4(root / "v4", "tiny", seed=0)), "v41": str(make_v41(root / "v41", "tiny", seed=0))}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["v4", "v41"])
def test_forked_samples_copy_the_whole_model_state(family, tiny_checkpoints, one_thread):
    from deepinfer import LLM

    prompt = [(7 * i) % 500 + 3 for i in range(70)]  # past the window and several compressed entries
    kw = dict(model=tiny_checkpoints[family], accelerator="cpu", dtype="float32", max_model_len=160,
              max_num_batched_tokens=32, features={"batch_invariant": {"enabled": True}})
    params = SamplingParams(temperature=1.0, max_tokens=12, seq_seed=77, n=3, ignore_eos=True, prompt_logprobs=1)
    llm = LLM(max_num_seqs=4, **kw)
    try:
        (group,) = llm.generate([prompt], params, use_tqdm=False)
        alone = [llm.generate([prompt], params.clone(n=1, seq_seed=77 + i, prompt_logprobs=None),
                              use_tqdm=False)[0].outputs[0] for i in range(3)]
    finally:
        llm.shutdown()
    assert [o.token_ids for o in group.outputs] == [o.token_ids for o in alone]
    assert [o.cumulative_logprob for o in group.outputs] == [o.cumulative_logprob for o in alone]
    assert len(group.prompt_logprobs) == len(prompt) and all(math.isfinite(e[t].logprob) for e, t in
                                                              zip(group.prompt_logprobs[1:], prompt[1:]))
