"""Hostile inputs to the offline API: one bad request never costs another its output.

Each test here failed on the engine before the hardening issue: orphan requests from a failed
`generate`, values that passed validation and killed the batch, concurrent callers, and error
messages that named the wrong problem.
"""
from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from deepinfer import SamplingParams
from engine_helpers import TOY_VOCAB, run_all, toy_engine


@pytest.fixture(scope="module")
def llm(tiny_v4):
    from deepinfer import LLM

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two busy threads on two cores only slow these tests down
    engine = LLM(model=tiny_v4, accelerator="cpu", dtype="float32", max_model_len=64, max_num_seqs=4,
                 max_num_batched_tokens=32, async_pipeline=False)
    yield engine
    engine.shutdown()
    torch.set_num_threads(before)


GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [20, 21]]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


# ------------------------------------------------------------------ 2. admission is all-or-nothing


def test_a_failed_generate_leaves_no_request_behind(llm, monkeypatch):
    reference = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    encode = llm.engine.tokenizer.encode
    calls = []

    def interrupted(text, **kw):  # Ctrl-C while the third prompt is tokenised
        calls.append(text)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return encode(text, **kw)

    monkeypatch.setattr(llm.engine.tokenizer, "encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["one", "two", "three", "four"], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished()
    assert llm.engine.stats().slots_used == 0
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # counts only its own requests
    assert [o.outputs[0].finish_reason for o in again] == ["length"] * 3
    assert _tokens(again) == _tokens(reference)


def test_numpy_and_torch_token_arrays_are_prompts(llm):
    reference = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    arrays = [np.array(PROMPTS[0], dtype=np.int64), torch.tensor(PROMPTS[1], dtype=torch.int32),
              {"prompt_token_ids": np.array(PROMPTS[2], dtype=np.int16)}]
    assert _tokens(llm.generate(arrays, GREEDY, use_tqdm=False)) == reference
    assert _tokens(llm.generate(np.array(PROMPTS[0]), GREEDY, use_tqdm=False)) == reference[:1]  # one 1-D array
    # numpy integer scalars inside a list are token ids too
    assert _tokens(llm.generate([[np.int64(t) for t in PROMPTS[0]]], GREEDY, use_tqdm=False)) == reference[:1]


@pytest.mark.parametrize("bad, expected", [
    (np.array([1.0, 2.0]), "integer token ids; got an array of dtype float64"),
    (torch.ones(2, 2, dtype=torch.int64), "one-dimensional"),
    ([5, 2.5, 7], "the one at position 1 is 2.5 (float)"),
    ([5, "7"], "position 1 is '7' (str)"),
    ({"prompt_token_ids": [5, None]}, "position 1 is None"),
    ([5, True], "position 1 is True (bool)"),
])
def test_non_integer_token_ids_fail_alone_with_the_real_reason(llm, bad, expected):
    outs = llm.generate([PROMPTS[0], bad, PROMPTS[1]], GREEDY, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error"
    assert expected in outs[1].error and "outside the vocabulary" not in outs[1].error
    assert [o.outputs[0].finish_reason for o in (outs[0], outs[2])] == ["length", "length"]


def test_an_unserialisable_schema_is_refused_when_the_params_are_built():
    with pytest.raises(ValueError, match="so_args.*cannot be serialised"):
        SamplingParams(so_args={"schema_type": "json", "schema": {"type": "object", "default": object()}})


class _BrokenProcessor:
    """A logits processor whose admission raises something other than RequestRejected."""

    def add_request(self, request_id, params):
        if params.max_tokens == 3:
            raise TypeError("Object of type set is not JSON serializable")
        return False

    def remove_request(self, request_id):
        pass

    def pop_failures(self):
        return {}


def test_a_processor_that_raises_at_admission_fails_that_request_alone():
    engine = toy_engine(processors=[_BrokenProcessor()])
    params = [SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=0, max_tokens=3),
              SamplingParams(temperature=0, max_tokens=4)]
    outs = run_all(engine, [[5, 6], [7, 8], [9]], params)
    assert outs[1].outputs[0].finish_reason == "error" and "TypeError" in outs[1].error
    assert [len(o.outputs[0].token_ids) for o in (outs[0], outs[2])] == [4, 4]


# ------------------------------------------------- 3. values that pass validation never kill a batch


def test_a_tiny_temperature_samples_greedily_and_the_batch_completes():
    engine = toy_engine()
    prompts = [[5, 6, 7], [8, 9], [10, 11]]
    params = [SamplingParams(temperature=1e-39, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seq_seed=3),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    outs = run_all(engine, prompts, params)
    greedy = run_all(toy_engine(), prompts[:1], [params[2]])
    assert outs[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    assert all(len(o.outputs[0].token_ids) == 6 and o.error is None for o in outs)
    assert SamplingParams(temperature=1e-39).greedy and not SamplingParams(temperature=1e-4).greedy


def test_stop_token_ids_outside_the_vocabulary_fail_that_request_alone():
    engine = toy_engine()
    params = [SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[TOY_VOCAB + 5]),
              SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[3])]
    outs = run_all(engine, [[5, 6], [7, 8]], params)
    assert outs[0].outputs[0].finish_reason == "error"
    assert f"stop_token_ids [{TOY_VOCAB + 5}] are outside the vocabulary [0, {TOY_VOCAB})" in outs[0].error
    assert len(outs[1].outputs[0].token_ids) >= 2 and outs[1].error is None


def test_a_huge_top_k_means_no_top_k():
    prompts = [[5, 6, 7], [8, 9]]
    huge = [SamplingParams(temperature=0.9, top_k=2**63, max_tokens=6, ignore_eos=True, seq_seed=11 + i)
            for i in range(2)]
    off = [p.clone(top_k=0) for p in huge]
    assert _tokens(run_all(toy_engine(), prompts, huge)) == _tokens(run_all(toy_engine(), prompts, off))
    # the same through the sorted path (top_p forces it)
    huge_p = [p.clone(top_p=0.95) for p in huge]
    off_p = [p.clone(top_p=0.95) for p in off]
    assert _tokens(run_all(toy_engine(), prompts, huge_p)) == _tokens(run_all(toy_engine(), prompts, off_p))


def test_more_logprobs_than_the_vocabulary_fail_that_request_alone():
    outs = run_all(toy_engine(), [[5], [6]], [SamplingParams(temperature=0, max_tokens=2, logprobs=TOY_VOCAB + 1),
                                            SamplingParams(temperature=0, max_tokens=2, logprobs=3)])
    assert outs[0].outputs[0].finish_reason == "error" and "logprobs" in outs[0].error
    assert len(outs[1].outputs[0].logprobs) == 2


# ----------------------------------------------------------------- 4. generate() from two threads


def test_generate_from_two_threads_is_serialised(llm):
    reference = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    start = threading.Barrier(2)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def call(index):
        try:
            start.wait()
            results[index] = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a generate() call hung"
    assert not errors, errors
    assert results == {0: reference, 1: reference}


def test_generate_inside_generate_on_one_thread_raises_instead_of_hanging(llm, monkeypatch):
    step = llm.engine.step
    seen = []

    def reentrant():
        if not seen:
            with pytest.raises(RuntimeError, match="called again from inside a running generate"):
                llm.generate([[5]], GREEDY, use_tqdm=False)
            seen.append(True)
        return step()

    monkeypatch.setattr(llm.engine, "step", reentrant)
    outs = llm.generate([[5, 6]], GREEDY, use_tqdm=False)
    assert seen and outs[0].outputs[0].finish_reason == "length"


# ------------------------------------------------------------------ 7. messages that name the problem


def test_a_lone_surrogate_in_a_prompt_names_the_problem(llm):
    outs = llm.generate(["ok", "bad \ud800 text"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert outs[0].error is None
    assert outs[1].outputs[0].finish_reason == "error"
    assert "lone surrogate" in outs[1].error and "character 4" in outs[1].error


def test_an_empty_model_name_is_an_error_not_the_default_model(clean_env):
    from deepinfer import LLM

    with pytest.raises(ValueError, match="model is an empty string"):
        LLM(model="")
    with pytest.raises(ValueError, match="model is an empty string"):
        LLM(model="   ")


@pytest.mark.parametrize("settings, expected", [
    ({"seed": 2**70}, "seed: Input should be less than 18446744073709551616"),
    ({"seed": -1}, "seed: Input should be greater than or equal to 0"),
    ({"cache_memory_gb": float("inf")}, "cache_memory_gb: Input should be a finite number"),
    ({"cache_memory_gb": float("nan")}, "cache_memory_gb: Input should be a finite number"),
])
def test_out_of_range_engine_settings_are_config_errors(settings, expected, clean_env):
    from deepinfer.config import load_config

    with pytest.raises(ValueError, match="invalid engine configuration") as err:
        load_config(settings)
    assert expected in str(err.value)


def test_a_cache_larger_than_the_machine_is_a_startup_error(tiny_v4, clean_env):
    from deepinfer import LLM

    with pytest.raises(ValueError, match=r"cache_memory_gb=1000000.0 is more than this machine can hold"):
        LLM(model=tiny_v4, accelerator="cpu", cache_memory_gb=1e6)


def test_a_misspelt_variable_is_warned_about_with_the_close_match(clean_env, caplog):
    from deepinfer import envs

    clean_env.setenv("DEEPINFER_ACCELERATR", "cpu")
    clean_env.setenv("DEEPINFER_TOTALLY_UNRELATED_KNOB", "1")
    clean_env.setattr(envs, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        assert envs.warn_unknown() == ["DEEPINFER_ACCELERATR", "DEEPINFER_TOTALLY_UNRELATED_KNOB"]
        envs.warn_unknown()  # once per name
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "DEEPINFER_ACCELERATR" in messages[0] and "did you mean DEEPINFER_ACCELERATOR?" in messages[0]
    assert "no effect" in messages[1]


def test_building_an_engine_warns_about_unknown_variables(tiny_v4, clean_env, caplog):
    from deepinfer import LLM, envs

    clean_env.setenv("DEEPINFER_CPU_NATVE", "0")
    clean_env.setattr(envs, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        LLM(model=tiny_v4, accelerator="cpu", dtype="float32", max_model_len=32, max_num_seqs=1).shutdown()
    assert any("did you mean DEEPINFER_CPU_NATIVE?" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------- 8. aborts from another thread end generate()


LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
ABORTS = {  # what another thread calls, given the ids of the two requests, and which of them it aborts
    "engine.abort_all": (lambda llm, ids: llm.engine.abort_all(), {0, 1}),
    "engine.abort": (lambda llm, ids: llm.engine.abort([ids[0]]), {0}),
    "LLM.abort_all": (lambda llm, ids: llm.abort_all(), {0, 1}),
    "LLM.abort": (lambda llm, ids: llm.abort(ids[0]), {0}),
}


def _pause_on_third(target, name, monkeypatch, inside_step: bool):
    """Patch `target.name` so that its third call (inside a step, or right after a step returned)
    signals `paused` and waits for `resume`."""
    real, calls = getattr(target, name), []
    paused, resume = threading.Event(), threading.Event()

    def patched(*args):
        calls.append(1)
        if len(calls) == 3 and inside_step:
            paused.set()
            assert resume.wait(60)
        out = real(*args)
        if len(calls) == 3 and not inside_step:
            paused.set()
            assert resume.wait(60)
        return out

    monkeypatch.setattr(target, name, patched)
    return paused, resume


@pytest.mark.parametrize("how", list(ABORTS))
@pytest.mark.parametrize("inside_step", [True, False], ids=["during-a-step", "between-steps"])
def test_an_abort_from_another_thread_ends_generate(llm, monkeypatch, how, inside_step):
    reference = llm.generate(PROMPTS[:2], LONG, use_tqdm=False)
    # during a step: the abort waits for it (the step holds the engine); between steps: it applies at once
    target, name = (llm.engine.executor, "execute") if inside_step else (llm.engine, "step")
    paused, resume = _pause_on_third(target, name, monkeypatch, inside_step)
    abort, aborted = ABORTS[how]
    # the engine's own methods with the ids it numbered; LLM's with the ids given to generate
    named = how.startswith("LLM")
    result: list = []
    worker = threading.Thread(target=lambda: result.append(
        llm.generate(PROMPTS[:2], LONG, use_tqdm=False, **({"request_ids": ["a", "b"]} if named else {}))),
        daemon=True)
    worker.start()
    assert paused.wait(60)
    abort(llm, ["a", "b"] if named else list(llm.engine.scheduler.requests))
    resume.set()
    worker.join(timeout=60)
    assert not worker.is_alive(), "generate() did not return after the abort"
    (outs,) = result
    monkeypatch.undo()
    if named:
        assert [o.request_id for o in outs] == ["a", "b"]
    for i, (out, ref) in enumerate(zip(outs, reference)):
        tokens = out.outputs[0].token_ids
        if i in aborted:
            # three steps ran; the abort took effect at the next step boundary
            assert out.outputs[0].finish_reason == "abort" and out.finished
            assert tokens == ref.outputs[0].token_ids[:3]
        else:
            assert out.outputs[0].finish_reason == "length" and tokens == ref.outputs[0].token_ids
    assert not llm.engine.has_unfinished() and llm.engine.stats().slots_used == 0
    assert _tokens(llm.generate(PROMPTS[:2], LONG, use_tqdm=False)) == _tokens(reference)


def test_abort_ignores_unknown_ids_and_generate_checks_its_request_ids(llm):
    llm.abort(["nobody"])  # nothing runs: a no-op
    llm.abort_all()
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, request_ids=("x", "y"))
    assert [o.request_id for o in outs] == ["x", "y"]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    with pytest.raises(ValueError, match="'x' appears more than once"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, request_ids=["x", "x"])
    with pytest.raises(ValueError, match="got 1 request_ids for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, request_ids=["x"])
    with pytest.raises(TypeError, match=r"request_ids\[1\] is 7"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, request_ids=["x", 7])
    with pytest.raises(TypeError, match="request ids are strings; got 3"):
        llm.abort([3])
    assert not llm.engine.has_unfinished()
