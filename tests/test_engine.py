"""The engine loop on a toy model (fast; stop rules, errors, logits processors, threads) and on a
tiny random DeepSeek-V4 checkpoint in fp32 (batching, preemption, async pipeline, seeds)."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from deepinfer.logits_processor import LogitsProcessor, RequestRejected
from deepinfer.sampling_params import SamplingParams
from deepinfer.engine.speculative import Drafts, Speculation, SpeculativeDecoder
from engine_helpers import FaultyToyModel, ToyModel, run_all, toy_engine

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _prompts(n: int, seed: int = 0, vocab: int = 64, max_len: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


# ---------------------------------------------------------------------------------- toy model


@pytest.mark.parametrize("async_pipeline", [False, True])
def test_toy_batch_with_preemption_matches_batch_of_one(async_pipeline):
    prompts = _prompts(24)
    reference = []
    for p in prompts:
        e = toy_engine(max_num_seqs=1, num_slots=1, max_num_batched_tokens=256)
        reference += _tokens(run_all(e, [p], [GREEDY]))
    e = toy_engine(num_blocks=5, block_size=4, max_num_batched_tokens=7, async_pipeline=async_pipeline)
    outs = run_all(e, prompts, [GREEDY] * len(prompts))
    assert e.scheduler.num_preemptions > 0
    assert _tokens(outs) == reference
    assert e.cache.stats().slots_used == 0
    e.shutdown()


def test_outputs_are_in_order_with_metrics():
    e = toy_engine()
    outs = run_all(e, ["hello", [5, 6, 7], {"prompt_token_ids": [9, 9]}], [GREEDY] * 3)
    assert [o.request_id for o in outs] == ["0", "1", "2"]
    assert outs[0].prompt == "hello" and outs[0].prompt_token_ids[0] == 0  # BOS added to text prompts
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [5, 6, 7]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "length" and len(c.token_ids) == 12
        assert o.metrics.decode_ppl is not None and o.metrics.decode_ppl >= 1.0
        assert o.metrics.accept_rate is None and o.metrics.num_output_tokens == 12
        assert c.cumulative_logprob == pytest.approx(-12 * torch.log(torch.tensor(o.metrics.decode_ppl)).item(), rel=1e-5)
        assert c.text == e.tokenizer.decode(c.token_ids)


def _first_run(prompt, **params):
    e = toy_engine()
    return run_all(e, [prompt], [SamplingParams(**{"temperature": 0, "max_tokens": 12, **params})])[0].outputs[0]


def test_stop_token_ids_and_eos():
    base = _first_run([5, 6, 7])
    stop = base.token_ids[4]
    first = base.token_ids.index(stop)
    out = _first_run([5, 6, 7], stop_token_ids=[stop])
    assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop
    # the same token as EOS: stops there; ignore_eos runs to max_tokens; min_tokens bans it first
    e = toy_engine(eos_token_ids={stop})
    eos_out = run_all(e, [[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=12)])[0].outputs[0]
    assert eos_out.token_ids == base.token_ids[:first + 1] and eos_out.finish_reason == "stop"
    assert eos_out.stop_reason is None and eos_out.text == e.tokenizer.decode(base.token_ids[:first])
    ignored = run_all(e, [[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)])[0].outputs[0]
    assert ignored.token_ids == base.token_ids and ignored.finish_reason == "length"
    held = run_all(e, [[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2)])[0].outputs[0]
    assert stop not in held.token_ids[:first + 2]


def test_stop_strings_cut_the_text():
    base = _first_run([8, 9])
    stop = base.text[4:6]
    out = _first_run([8, 9], stop=["@@", stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:base.text.index(stop)]
    assert len(out.token_ids) == base.text.index(stop) + 2  # one character per toy token


def test_max_tokens_and_max_model_len():
    e = toy_engine(max_model_len=10)
    outs = run_all(e, [[5] * 7, [5] * 9], [SamplingParams(temperature=0, max_tokens=50)] * 2)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 1]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    assert len(_first_run([4], max_tokens=3).token_ids) == 3


def test_a_prompt_of_max_model_len_tokens_is_refused_alone():
    """As vLLM: the prompt and at least one generated token must fit in max_model_len."""
    e = toy_engine(max_model_len=10)
    outs = run_all(e, [[5] * 9, [5] * 10, [6] * 4], [SamplingParams(temperature=0, max_tokens=50)] * 3)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert "the prompt has 10 tokens" in outs[1].error and "max_model_len=10" in outs[1].error
    assert "at most 9 prompt tokens" in outs[1].error and outs[1].outputs[0].token_ids == []
    assert [len(o.outputs[0].token_ids) for o in (outs[0], outs[2])] == [1, 6]


def test_bad_requests_fail_alone():
    e = toy_engine(max_model_len=20)
    bad_params = SamplingParams(temperature=0, max_tokens=4)
    bad_params.top_p = 7.0  # changed after it was validated
    prompts = ["", [3] * 21, [5, 64], [5, 6], {"nope": 1}, [5, 7], 3.5, [5, 8]]
    params = [GREEDY, GREEDY, GREEDY, bad_params, GREEDY, SamplingParams(so_args={"schema_type": "regex", "schema": "a"}),
              GREEDY, GREEDY]
    outs = run_all(e, prompts, params)
    errors = [o.error for o in outs]
    assert [o.outputs[0].finish_reason for o in outs] == ["error"] * 7 + ["length"]
    assert "empty" in errors[0] and "max_model_len=20" in errors[1] and "outside the vocabulary [0, 64)" in errors[2]
    assert "top_p" in errors[3] and "prompt_token_ids" in errors[4] and "structured_output" in errors[5]
    assert "float" in errors[6] and errors[7] is None
    assert len(outs[7].outputs[0].token_ids) == 12


def test_logprobs_are_returned_per_token():
    out = _first_run([5, 6], logprobs=2)
    assert len(out.logprobs) == 12
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1 and len(entry) == 2  # greedy: sampled = top 1
        assert sum(lp.logprob for lp in entry.values()) < 0


class CountingGrammar(LogitsProcessor):
    """Allows exactly one token per step: the previous token + 1 (starting at 10); completes after
    `length` tokens. The mask for step N+1 depends on the token sampled at step N."""

    def __init__(self, length: int = 6, dead_at: int | None = None, fail_at: int | None = None):
        self.length, self.dead_at, self.fail_at = length, dead_at, fail_at
        self.state: dict[str, list[int]] = {}
        self.failures: dict[str, tuple[str, str]] = {}
        self.removed: list[str] = []

    def add_request(self, request_id, sampling_params):
        if sampling_params.so_args is None:
            return False
        if sampling_params.so_args["schema"] == "reject":
            raise RequestRejected("bad grammar: reject")
        self.state[request_id] = []
        return True

    def remove_request(self, request_id):
        self.removed.append(request_id)
        self.state.pop(request_id, None)

    def fill_bitmask(self, request_ids, bitmask, draft_tokens=None):
        for row, rid in enumerate(request_ids):
            seen = self.state[rid]
            bitmask[row] = 0
            if self.dead_at is not None and len(seen) == self.dead_at:
                continue  # nothing allowed
            nxt = seen[-1] + 1 if seen else 10
            bitmask[row, nxt // 32] = 1 << (nxt % 32) if nxt % 32 != 31 else -(1 << 31)

    def accept(self, request_id, token_ids):
        seen = self.state[request_id]
        expected = seen[-1] + 1 if seen else 10
        assert token_ids == [expected], f"sampled {token_ids} but the mask allowed only {expected}"
        seen += token_ids
        if self.fail_at is not None and len(seen) == self.fail_at:
            self.failures[request_id] = ("error", "grammar state broke")
            return True
        return len(seen) >= self.length

    def pop_failures(self):
        out, self.failures = self.failures, {}
        return out


SO = {"schema_type": "regex", "schema": "count"}


@pytest.mark.parametrize("async_pipeline", [False, True])
def test_logits_processor_masks_each_step_in_order(async_pipeline):
    grammar = CountingGrammar(length=6)
    e = toy_engine(processors=[grammar], async_pipeline=async_pipeline)
    params = [SamplingParams(temperature=1.0, max_tokens=20, so_args=SO, seq_seed=3),
              SamplingParams(temperature=0, max_tokens=5),
              SamplingParams(temperature=0.7, max_tokens=20, so_args=SO)]
    outs = run_all(e, [[5, 6], [7], [8, 9, 10]], params)
    assert outs[0].outputs[0].token_ids == [10, 11, 12, 13, 14, 15] and outs[0].outputs[0].finish_reason == "stop"
    assert outs[2].outputs[0].token_ids == [10, 11, 12, 13, 14, 15]
    assert len(outs[1].outputs[0].token_ids) == 5
    assert sorted(grammar.removed) == ["0", "2"]
    e.shutdown()


@pytest.mark.parametrize("async_pipeline", [False, True])
def test_all_masked_row_ends_the_request_as_dead_end(async_pipeline):
    e = toy_engine(processors=[CountingGrammar(length=10, dead_at=3)], async_pipeline=async_pipeline)
    out = run_all(e, [[5, 6], [7]], [SamplingParams(max_tokens=20, so_args=SO), GREEDY])
    assert out[0].outputs[0].token_ids == [10, 11, 12]
    assert out[0].outputs[0].finish_reason == "grammar_dead_end" and "masked" in out[0].error
    assert out[1].outputs[0].finish_reason == "length"
    e.shutdown()


# ------------------------------------------------------------------- non-finite logits fail one request


class NextTokenDrafter:
    """Drafts `last + 1, last + 2, ...` (greedy drafts): sometimes right, mostly rejected."""

    features = None
    context_window = 0

    def propose(self, requests, features):
        return [Drafts([(r.emitted[-1] + 1 + i) % 64 for i in range(r.num_drafts)], [0.5] * r.num_drafts)
                if r.num_drafts else None for r in requests]

    def forget(self, request_id):
        pass


def _faulty_engine(fault: str, async_pipeline: bool, speculative: bool, processors=None, after: int = 6):
    e = toy_engine(model=FaultyToyModel(fault, trigger=POISON, after=after), async_pipeline=async_pipeline,
                   processors=processors)
    if speculative:
        e.speculator = SpeculativeDecoder(Speculation(NextTokenDrafter(), 2), e.sampler, e.accelerator, 256)
        e.runner.speculator = e.scheduler.speculator = e.speculator
    return e


POISON = 63  # a sequence starting with it gets broken logits from its 6th position on (output token 3)
FAULT_WORDS = {"nan": "1 NaN among 64 logits", "inf": "1 +inf among 64 logits", "-inf": "all 64 logits are -inf"}
KINDS = {"greedy": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
         "sampled": SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seq_seed=11, ignore_eos=True),
         "constrained": SamplingParams(temperature=0.7, max_tokens=8, so_args=SO, ignore_eos=True)}


def _check_one_request_fails(fault, kind, async_pipeline, speculative):
    params = KINDS[kind]
    prompts = [[7, 8], [POISON, 5, 6], [9, 10, 11]]
    others = [GREEDY, SamplingParams(temperature=1.0, max_tokens=10, seq_seed=5)]

    def engine(after=6):
        return _faulty_engine(fault, async_pipeline, speculative, [CountingGrammar(length=20)], after)

    alone = [_tokens(run_all(engine(), [p], [sp]))[0] for p, sp in zip(prompts[::2], others)]
    healthy = _tokens(run_all(engine(after=10**9), prompts[1:2], [params]))[0]  # the same request, no fault
    e = engine()
    outs = run_all(e, prompts, [others[0], params, others[1]])
    bad = outs[1]
    assert bad.outputs[0].finish_reason == "error", bad.outputs[0].finish_reason
    assert "output token 3 are not finite" in bad.error and FAULT_WORDS[fault] in bad.error, bad.error
    assert bad.outputs[0].token_ids == healthy[:3]  # the tokens before the broken position are kept
    assert [o.outputs[0].finish_reason for o in (outs[0], outs[2])] == ["length", "length"]
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone  # as if alone
    assert all(o.metrics.decode_ppl is not None and o.metrics.decode_ppl < float("inf") for o in outs)
    assert e.stats().slots_used == 0
    e.shutdown()


@pytest.mark.parametrize("async_pipeline", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("fault", sorted(FAULT_WORDS))
def test_non_finite_logits_fail_that_request_alone(fault, kind, async_pipeline):
    _check_one_request_fails(fault, kind, async_pipeline, speculative=False)


@pytest.mark.parametrize("async_pipeline", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_non_finite_logits_under_speculative_verification(kind, async_pipeline):
    _check_one_request_fails("nan", kind, async_pipeline, speculative=True)


def test_processor_failures_and_rejections_fail_only_that_request():
    e = toy_engine(processors=[CountingGrammar(length=10, fail_at=2)])
    reject = {"schema_type": "regex", "schema": "reject"}
    outs = run_all(e, [[5], [6], [7]], [SamplingParams(max_tokens=20, so_args=SO),
                                        SamplingParams(max_tokens=20, so_args=reject), GREEDY])
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].error == "grammar state broke"
    assert outs[0].outputs[0].token_ids == [10]  # the token that broke the grammar is discarded
    assert outs[1].outputs[0].finish_reason == "error" and "bad grammar" in outs[1].error
    assert outs[2].outputs[0].finish_reason == "length"


def _started_worker(before: set[threading.Thread]) -> threading.Thread:
    """The one step-worker thread started since `before` was taken."""
    [thread] = [t for t in threading.enumerate() if t not in before and t.name == "deepinfer-step-worker"]
    return thread


def test_async_worker_is_a_daemon_and_shutdown_joins_it():
    before = set(threading.enumerate())
    e = toy_engine(async_pipeline=True)
    thread = _started_worker(before)
    assert thread.daemon and thread.is_alive()
    run_all(e, _prompts(3), [GREEDY] * 3)
    e.shutdown()
    assert not thread.is_alive()
    e.shutdown()  # idempotent


def test_an_error_in_the_forward_reaches_the_caller_and_shutdown_still_joins():
    model = ToyModel()
    before = set(threading.enumerate())
    e = toy_engine(async_pipeline=True, model=model)
    thread = _started_worker(before)
    original = model.forward

    def broken(batch):
        if model.forward_calls >= 3:
            raise KeyboardInterrupt  # what Ctrl-C looks like if it lands in the worker
        return original(batch)
    model.forward = broken
    for p in _prompts(3):
        e.add_request(p, GREEDY)
    with pytest.raises(KeyboardInterrupt):
        while e.has_unfinished():
            e.step()
    e.abort_all()
    e.shutdown()
    assert not thread.is_alive() and thread not in threading.enumerate()


@pytest.mark.parametrize("async_pipeline", [False, True])
def test_an_abort_from_another_thread_waits_for_the_running_step_and_spares_later_requests(async_pipeline):
    model = ToyModel()
    engine = toy_engine(model=model, async_pipeline=async_pipeline)
    first = engine.add_request([5, 6, 7], GREEDY)
    real, inside, release = model.forward, threading.Event(), threading.Event()

    def blocking(batch):
        inside.set()
        assert release.wait(60)
        return real(batch)

    model.forward = blocking
    # async: the first step only queues the forward; the second waits for it, holding the engine
    stepper = threading.Thread(target=lambda: [engine.step() for _ in range(2 if async_pipeline else 1)])
    stepper.start()
    assert inside.wait(60)
    # the step owns the request state: the abort waits in the mailbox
    applied = engine.abort_all()
    assert not first.is_finished and applied == []
    model.forward = real
    release.set()
    stepper.join(timeout=60)
    assert not stepper.is_alive()
    later = engine.add_request([8, 9], GREEDY)  # admitted after the abort: not touched by it
    assert first in engine.step() and first.finish_reason == "abort"
    assert len(first.output_token_ids) == 1  # the step that was running when the abort came
    while engine.has_unfinished():
        engine.step()
    assert later.finish_reason == "length" and len(later.output_token_ids) == GREEDY.max_tokens
    assert engine.stats().slots_used == 0
    engine.shutdown()


def test_seq_seed_on_toy_model_is_batch_independent():
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seq_seed=1234)
    alone = _tokens(run_all(toy_engine(), [[5, 6]], [p]))[0]
    e = toy_engine(async_pipeline=True, max_num_batched_tokens=5)
    mixed = run_all(e, [[9] * 7, [5, 6], [3]], [SamplingParams(temperature=1.0, max_tokens=10), p, GREEDY])
    assert _tokens(mixed)[1] == alone
    other = _tokens(run_all(toy_engine(), [[5, 6]], [p.clone(seq_seed=99)]))[0]
    assert other != alone
    e.shutdown()


def test_dummy_run_forwards_a_synthetic_verify_batch_and_gives_the_cache_back():
    model = ToyModel()
    e = toy_engine(model=model, num_slots=3)
    seen = []
    forward = model.forward
    model.forward = lambda batch: seen.append((batch.query_lens, batch.context_lens)) or forward(batch)
    e.runner.dummy_run(e.cache, num_seqs=3, query_len=4, context_len=5, token=9)
    assert seen == [([4, 4, 4], [5, 5, 5])]
    assert e.stats().slots_used == 0 and e.stats().blocks_used == {"c4": 0}
    with pytest.raises(RuntimeError, match="cache pool is too small"):
        e.runner.dummy_run(e.cache, num_seqs=4, query_len=1, context_len=1)
    assert e.stats().slots_used == 0
    assert run_all(e, [[5, 6]], [GREEDY])[0].outputs[0].finish_reason == "length"  # the engine carries on


# ------------------------------------------------------------------ tiny DeepSeek-V4 checkpoint


def _llm(path, **kw):
    from deepinfer import LLM

    base = dict(model=path, accelerator="cpu", dtype="float32", max_model_len=64, max_num_seqs=4,
                max_num_batched_tokens=32)
    base.update(kw)
    return LLM(**base)


@pytest.mark.slow
def test_tiny_batch_of_32_with_preemption_equals_each_batch_of_one(tiny_v4, one_thread):
    prompts = _prompts(32, seed=1, vocab=512, max_len=24)
    params = [SamplingParams(temperature=0, max_tokens=4 + i % 5, ignore_eos=True) for i in range(32)]
    single = _llm(tiny_v4, max_num_seqs=1, max_num_batched_tokens=64, async_pipeline=False)
    reference = [single.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    single.shutdown()
    # a pool of about 2.5 full-length requests for 4 running sequences: preemption is forced
    probe = _llm(tiny_v4, async_pipeline=False)
    per_request = probe.build_info.pool.bytes_per_max_request
    probe.shutdown()
    llm = _llm(tiny_v4, max_num_batched_tokens=13, cache_memory_gb=2.5 * per_request / 2**30,
               async_pipeline=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    assert llm.engine.stats().slots_used == 0
    llm.shutdown()


def test_async_pipeline_auto_follows_the_back_end(tiny_v4, one_thread):
    # auto (None) resolves from Capabilities.host_overlap: the cpu back end shares its cores with
    # the host thread, so it runs synchronously unless asked; an explicit value always wins
    auto = _llm(tiny_v4)
    assert auto.config.async_pipeline is False and auto.engine.worker is None
    auto.shutdown()
    forced = _llm(tiny_v4, async_pipeline=True)
    assert forced.config.async_pipeline is True and forced.engine.worker is not None
    forced.shutdown()


def test_tiny_async_on_off_identical_and_seq_seed_batch_invariant(tiny_v4, one_thread):
    prompts = ["The quick brown fox", [7, 8, 9], "jumps over", [100] * 20, "lazy dog"]
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10, seq_seed=11 + i, ignore_eos=True)
              for i in range(len(prompts))]
    runs = {}
    for mode in (True, False):
        llm = _llm(tiny_v4, async_pipeline=mode, max_num_batched_tokens=16)
        runs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if mode:
            alone = llm.generate(prompts[1], params[1], use_tqdm=False)[0].outputs[0].token_ids
            other = llm.generate(prompts[1], params[1].clone(seq_seed=999), use_tqdm=False)[0].outputs[0].token_ids
        llm.shutdown()
    assert runs[True] == runs[False]
    assert alone == runs[True][1] and other != alone


def test_tiny_cache_budget_too_small_is_a_startup_error(tiny_v4):
    with pytest.raises(ValueError, match=r"too small: one request of max_model_len=64 tokens needs .* cache_memory_gb"):
        _llm(tiny_v4, cache_memory_gb=1e-6)


def test_interrupted_generate_aborts_and_the_engine_stays_usable(tiny_v4, one_thread):
    before = set(threading.enumerate())
    llm = _llm(tiny_v4, async_pipeline=True)
    thread = _started_worker(before)
    expected = llm.generate(["abc", "def"], GREEDY, use_tqdm=False)
    engine = llm.engine
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()
    engine.step = step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["abc", "def", "ghi"], GREEDY, use_tqdm=False)
    engine.step = real_step
    assert engine.stats().slots_used == 0 and not engine.has_unfinished()
    again = llm.generate(["abc", "def"], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]
    llm.shutdown()
    assert not thread.is_alive()


def test_llm_arguments_config_file_and_stats(tiny_v4, tmp_path, one_thread):
    from deepinfer import LLM
    from deepinfer.config import EngineConfig

    with pytest.raises(TypeError, match="unknown arguments \\['max_seqs'\\]; valid engine settings: .*max_num_seqs"):
        LLM(model=tiny_v4, max_seqs=3)
    toml = tmp_path / "engine.toml"
    toml.write_text("max_num_seqs = 3\nasync_pipeline = false\nmax_model_len = 48\n")
    llm = LLM(model=tiny_v4, config=str(toml), max_model_len=40)  # the argument wins over the file
    assert (llm.config.max_num_seqs, llm.config.async_pipeline, llm.engine.max_model_len) == (3, False, 40)
    assert llm.engine.worker is None
    llm.generate(["hi"], GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats["slots_total"] == 3 and stats["slots_used"] == 0 and stats["num_steps"] > 0
    assert 0 < stats["peak_cache_usage"] <= 1
    llm.shutdown()
    llm = LLM(config=EngineConfig(model=str(tiny_v4), max_num_seqs=2, max_model_len=32), seed=5)
    assert llm.config.seed == 5 and llm.stats()["slots_total"] == 2
    llm.shutdown()
