"""DSpark speculative decoding end to end on a tiny random DeepSeek-V4 checkpoint (fp32, CPU):
lossless greedy outputs (fixed and variable length, both pipelines, preemption), full acceptance
with the self-drafting test mode, rollback across CSA/HCA window boundaries, the MTP drafter's
cache against a from-scratch reference, seeds, sampled distributions, structured outputs and the
reported statistics."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer.models.interface import ForwardBatch, allocate_cache_tensors
from deepinfer.sampling_params import SamplingParams
from example_modules import load_example

VOCAB = 512


@pytest.fixture(scope="module")
def tiny(tiny_v4) -> str:
    # window 8, CSA every 4 tokens, HCA every 16, index_topk 4: every kind of state moves within 40 tokens
    return str(tiny_v4)


@pytest.fixture(autouse=True)
def one_thread(clean_env):
    """Two torch threads on two busy cores can be 10x slower; nothing here measures time."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _llm(path, dspark: dict | None = None, **kw):
    from deepinfer import LLM

    base = dict(model=path, accelerator="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
                max_num_batched_tokens=64, features=None if dspark is None else {"dspark": dspark})
    base.update(kw)
    return LLM(**base)


def _generate(path, prompts, params, dspark=None, **kw):
    llm = _llm(path, dspark, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.spec_stats
    llm.shutdown()
    return outs, stats


def _mixed_batch(n: int = 16, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(n)]
    params = []
    for i in range(n):
        extra = {}
        if i % 5 == 1:
            extra["logprobs"] = 2
        if i % 7 == 3:
            extra["min_tokens"] = 3
        params.append(SamplingParams(temperature=0, max_tokens=3 + (i * 5) % 17, **extra))
    return prompts, params


@pytest.fixture(scope="module")
def reference(tiny):
    """Greedy outputs of the mixed batch without speculation."""
    prompts, params = _mixed_batch()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run outside the one_thread fixture
    outs, _ = _generate(tiny, prompts, params)
    torch.set_num_threads(before)
    return prompts, params, outs


def _same_as_reference(outs, ref):
    for got, want in zip(outs, ref):
        g, w = got.outputs[0], want.outputs[0]
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        if w.logprobs is not None:
            assert [list(e) for e in g.logprobs] == [list(e) for e in w.logprobs]  # the same top tokens
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)


# ------------------------------------------------------------------------------------ lossless


@pytest.mark.parametrize("dspark, async_pipeline", [
    ({}, False),  # the checkpoint's MTP block drafts (random weights: almost nothing is accepted)
    pytest.param({"variable_length": True}, True, marks=pytest.mark.slow),  # the last case drafts variable lengths too
    ({"drafter": "self", "self_draft_error_rate": 0.35}, True),  # partial acceptance at every position
    ({"drafter": "self", "num_draft_tokens": 3, "variable_length": True}, False),
])
def test_greedy_outputs_equal_speculation_off(tiny, reference, dspark, async_pipeline):
    prompts, params, ref = reference
    outs, stats = _generate(tiny, prompts, params, dspark, async_pipeline=async_pipeline)
    _same_as_reference(outs, ref)
    assert stats.num_verifications > 0 and stats.num_tokens_emitted <= sum(len(o.outputs[0].token_ids) for o in outs)
    if dspark.get("self_draft_error_rate"):
        assert 0.2 < stats.accept_rate < 0.9  # both acceptance and rejection happened


def test_self_drafting_accepts_every_draft_and_adds_the_bonus_token(tiny, reference):
    prompts, params, ref = reference
    llm = _llm(tiny, {"drafter": "self"}, async_pipeline=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.spec_stats
    _same_as_reference(outs, ref)
    assert stats.accept_rate == 1.0 and stats.acceptance_by_position[:3] == [1.0, 1.0, 1.0]
    assert stats.num_tokens_emitted == stats.num_drafts_verified + stats.num_verifications  # a bonus each time
    assert stats.mean_accepted_length > 3.0
    for o, p in zip(outs, params):
        m = o.metrics
        n = len(o.outputs[0].token_ids)  # the bonus token never overshoots max_tokens
        assert n == p.max_tokens if o.outputs[0].finish_reason == "length" else n < p.max_tokens
        assert m.num_accepted_tokens == m.num_draft_tokens
        assert m.accept_rate == (1.0 if m.num_draft_tokens else None)
    assert sum(o.metrics.num_draft_tokens for o in outs) == stats.num_drafts_verified
    assert llm.engine.stats().slots_used == 0
    # a stop token in the middle of an accepted run of drafts ends the request there
    i = next(i for i, o in enumerate(ref) if len(o.outputs[0].token_ids) >= 8)
    want = ref[i].outputs[0].token_ids
    stop = want[5]
    cut = want[:want.index(stop) + 1]
    got = llm.generate([prompts[i]], params[i].clone(stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert got.token_ids == cut and got.finish_reason == "stop" and got.stop_reason == stop
    llm.shutdown()


@pytest.mark.slow
def test_rollback_across_csa_and_hca_window_boundaries(tiny):
    """Prompts ending just before a CSA (4) and HCA (16) boundary: the first verification's drafts
    cross it and most are rejected, so the compressor rows, the compressed entries and the indexer
    keys of the crossed window are rewritten from the corrected tokens; later steps cross 32 and 48."""
    rng = random.Random(3)
    lengths = [12, 13, 14, 15, 29, 30, 31, 46, 47]
    prompts = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)] * len(prompts)
    ref, _ = _generate(tiny, prompts, params)
    outs, stats = _generate(tiny, prompts, params, {"drafter": "self", "self_draft_error_rate": 0.6,
                                                     "num_draft_tokens": 4})
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert 0 < stats.num_drafts_accepted < stats.num_drafts_verified
    assert all(a is not None and a < 1.0 for a in stats.acceptance_by_position)  # rejections at every position


@pytest.mark.slow
def test_preemption_with_speculation_stays_lossless(tiny, reference):
    prompts, params, ref = reference
    spec = {"drafter": "self", "self_draft_error_rate": 0.3, "num_draft_tokens": 3}
    probe = _llm(tiny, spec, async_pipeline=False)
    per_request = probe.build_info.pool.bytes_per_max_request
    probe.shutdown()
    llm = _llm(tiny, spec, max_num_batched_tokens=13, cache_memory_gb=2.5 * per_request / 2**30)
    outs = llm.generate(prompts[:10], params[:10], use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    _same_as_reference(outs, ref[:10])
    assert llm.engine.stats().slots_used == 0
    llm.shutdown()


# ----------------------------------------------------------------------------- the MTP drafter


def _mtp_reference_drafts(model, tokens: list[int], k: int) -> list[int]:
    """Greedy MTP drafts after `tokens`, computed from scratch in a fresh cache: the trunk over
    tokens[:-1], the MTP block over every position, then k - 1 chained single-row passes."""
    twin = model.twin()
    layout = twin.cache_layout(k + 1)
    twin.bind_cache(allocate_cache_tensors(layout, 1, {g.name: 64 for g in layout.block_groups}, 4, "cpu"))
    n = len(tokens) - 1
    tables = {g.name: torch.arange(64).unsqueeze(0) for g in layout.block_groups}
    ids = torch.tensor(tokens[:n])

    def batch(ids, start, logits_row):
        return ForwardBatch(input_ids=ids, positions=torch.arange(start, start + len(ids)), query_lens=[len(ids)],
                            context_lens=[start], slots=torch.tensor([0]), block_tables=tables,
                            logits_indices=torch.tensor([logits_row]), return_streams=True,
                            stream_indices=torch.arange(len(ids)))

    trunk = twin.forward(batch(ids, 0, n - 1))
    nxt = torch.tensor(tokens[1:])
    out = twin.mtp_forward(trunk.streams, nxt, batch(nxt, 0, n - 1))
    drafts = [int(out.logits[0].argmax())]
    streams = out.streams[n - 1:n]
    for i in range(1, k):
        ids = torch.tensor(drafts[-1:])
        b = batch(ids, n - 1 + i, 0)
        out = twin.mtp_forward(streams, ids, b)
        streams = out.streams
        drafts.append(int(out.logits[0].argmax()))
    return drafts


def test_mtp_drafts_equal_a_from_scratch_computation(tiny):
    """The MTP ring is fed only the trunk streams it needs (chunked prefill, verification rows);
    after rejections and chunking its drafts match a fresh computation over the whole sequence."""
    llm = _llm(tiny, {"num_draft_tokens": 3}, max_num_batched_tokens=11, async_pipeline=False)
    drafter = llm.engine.speculator.drafter
    seen = []
    propose = drafter.propose

    def recording(requests, features):
        result = propose(requests, features)
        for r, d in zip(requests, result):
            if d is not None:
                seen.append((r.tokens(0, r.num_tokens), list(d.token_ids)))
        return result

    drafter.propose = recording
    rng = random.Random(5)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (3, 9, 17, 25)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    model = llm.engine.model
    assert len(seen) > 20
    for tokens, drafts in seen:
        assert drafts == _mtp_reference_drafts(model, tokens, len(drafts))[:len(drafts)]
    llm.shutdown()


def test_a_checkpoint_without_mtp_weights_is_a_clear_error(tmp_path):
    from deepinfer.models.deepseek_v4.make_model import make_model

    path = make_model(tmp_path / "nomtp", size="tiny", seed=0, with_mtp=False)
    with pytest.raises(ValueError, match="MTP block"):
        _llm(str(path), {})
    llm = _llm(str(path), {"drafter": "self"})  # the self-drafting test mode needs no MTP
    assert llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()


# ---------------------------------------------------------------------------- sampling and seeds


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seq_seed=1234, ignore_eos=True)
    spec = {"drafter": "self"}
    alone, _ = _generate(tiny, [[7, 8, 9]], [p], spec)
    again, _ = _generate(tiny, [[7, 8, 9]], [p], spec, async_pipeline=False)
    mixed, stats = _generate(tiny, [[9] * 20, [7, 8, 9], [3]],
                             [SamplingParams(temperature=1.0, max_tokens=12), p, SamplingParams(temperature=0)],
                             spec)
    assert alone[0].outputs[0].token_ids == again[0].outputs[0].token_ids == mixed[1].outputs[0].token_ids
    assert stats.num_drafts_accepted > 0  # the tokens went through rejection sampling
    other, _ = _generate(tiny, [[7, 8, 9]], [p.clone(seq_seed=99)], spec)
    assert other[0].outputs[0].token_ids != alone[0].outputs[0].token_ids


def _two_sample_chi_square_p(a: list[tuple], b: list[tuple]) -> float:
    """Homogeneity of two samples of categories; categories rarer than 10 in all are pooled."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    keys = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10]
    rows = [[ca[k] for k in keys] + [len(a) - sum(ca[k] for k in keys)],
            [cb[k] for k in keys] + [len(b) - sum(cb[k] for k in keys)]]
    table = torch.tensor(rows, dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


SAMPLED = dict(n=300, prompt=[11, 12, 13, 14, 15, 16], engine=dict(max_num_seqs=64, max_num_batched_tokens=512))


def _sampled_params(seed0: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seq_seed=seed0 + i, ignore_eos=True)
            for i in range(SAMPLED["n"])]


@pytest.fixture(scope="module")
def sampled_without_speculation(tiny):
    outs, _ = _generate(tiny, [SAMPLED["prompt"]] * SAMPLED["n"], _sampled_params(1000), **SAMPLED["engine"])
    return outs


@pytest.mark.parametrize("dspark", [{}, {"drafter": "self", "num_draft_tokens": 2}])
@pytest.mark.slow
def test_sampled_tokens_keep_their_distribution(tiny, sampled_without_speculation, dspark):
    """Smaller end-to-end check (acceptance.py is checked on exact distributions in
    test_dspark_units.py): the first three generated tokens, sampled 300 times with and without
    speculation, agree (two-sample chi-square). The random MTP drafter exercises the residual
    distribution (its drafts are nearly always rejected), the self drafter the accept path."""
    off = sampled_without_speculation
    on, stats = _generate(tiny, [SAMPLED["prompt"]] * SAMPLED["n"], _sampled_params(10**6), dspark,
                          **SAMPLED["engine"])
    assert stats.num_drafts_verified > 0
    a = [tuple(o.outputs[0].token_ids) for o in off]
    b = [tuple(o.outputs[0].token_ids) for o in on]
    assert len(set(a)) > 5  # a real distribution, not a near-deterministic one
    assert _two_sample_chi_square_p(a, b) > 1e-3
    assert _two_sample_chi_square_p([t[1:] for t in a], [t[1:] for t in b]) > 1e-3


# --------------------------------------------------------------------------- structured outputs


@pytest.fixture(scope="module")
def tiny_real_vocab(tiny_v4_real_vocab) -> str:
    return str(tiny_v4_real_vocab)


@pytest.mark.slow
def test_drafts_the_grammar_rejects_are_never_emitted(tiny_real_vocab):
    samples = load_example("_structured_output.py")

    prompts, greedy = samples.sample_requests(max_tokens=32)
    sampled = [p.clone(temperature=1.0, seq_seed=i) for i, p in enumerate(greedy)]
    params = greedy + sampled
    prompts = prompts * 2
    ref, _ = _generate(tiny_real_vocab, prompts, params, max_model_len=256)
    llm = _llm(tiny_real_vocab, {"drafter": "self", "self_draft_error_rate": 0.5}, max_model_len=256)
    processor = next(p for p in llm.engine.processors if hasattr(p, "count_valid_draft"))
    trimmed = []
    count = processor.count_valid_draft

    def counting(request_id, drafts):
        valid = count(request_id, drafts)
        trimmed.append(len(drafts) - valid)
        return valid

    processor.count_valid_draft = counting
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    assert sum(trimmed) > 0  # the drafter did propose tokens the grammar forbids
    eos = llm.tokenizer.eos_token_id
    assert samples.check_outputs(params, outs, eos) == []
    for got, want in zip(outs[:len(greedy)], ref[:len(greedy)]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


# ----------------------------------------------------------------------------- reported figures


def test_accept_rate_reaches_the_request_output_and_the_example_line(tiny):
    offline_inference = load_example("offline_inference.py")

    outs, stats = _generate(tiny, [[5, 6, 7, 8]], [SamplingParams(temperature=0, max_tokens=12)],
                            {"drafter": "self", "self_draft_error_rate": 0.4})
    m = outs[0].metrics
    assert m.num_draft_tokens > 0 and m.accept_rate == pytest.approx(m.num_accepted_tokens / m.num_draft_tokens)
    assert f"accept_rate={m.accept_rate:.3f}" in offline_inference.format_result(0, "x", outs[0])
    assert stats.mean_verified_drafts <= 5 and stats.verified_drafts_per_step > 0
    off, none = _generate(tiny, [[5, 6, 7, 8]], [SamplingParams(temperature=0, max_tokens=4)])
    assert off[0].metrics.accept_rate is None and none is None


def test_environment_variables_turn_speculation_on_and_off(tiny, clean_env):
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    clean_env.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    llm = _llm(tiny)
    spec = llm.engine.speculator
    assert spec is not None and spec.num_draft_tokens == 2 and spec.policy.cost_model is not None
    assert llm.engine.cache.layout.max_rollback == 3
    llm.shutdown()
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    llm = _llm(tiny)
    assert llm.engine.speculator is None and llm.engine.spec_stats is None
    llm.shutdown()
    clean_env.delenv("DEEPINFER_USE_NEXTN_DECODE")
    clean_env.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")  # fixed-length verification only: speculation stays off
    llm = _llm(tiny)
    assert llm.engine.speculator is None
    llm.shutdown()
