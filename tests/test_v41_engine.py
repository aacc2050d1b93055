"""DeepSeek-V4.1 through the whole engine: continuous batching, chunked prefill, preemption and the
async pipeline do not change greedy outputs; structured outputs hold; speculative decoding is
refused with a reason; the conformance kit runs on a V4.1 checkpoint."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer.sampling_params import SamplingParams
from example_modules import load_example


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _llm(path, **kw):
    from deepinfer import LLM

    base = dict(model=path, accelerator="cpu", dtype="float32", max_model_len=80, max_num_seqs=4,
                max_num_batched_tokens=32)
    return LLM(**{**base, **kw})


def _prompts(n: int, seed: int, vocab: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]


@pytest.mark.slow
def test_batch_with_preemption_and_async_equals_each_batch_of_one(tiny_v41, one_thread):
    prompts = _prompts(16, seed=1, vocab=512, max_len=40)
    params = [SamplingParams(temperature=0, max_tokens=6 + i % 5, ignore_eos=True) for i in range(16)]
    single = _llm(tiny_v41, max_num_seqs=1, max_num_batched_tokens=96, async_pipeline=False)
    reference = [single.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    per_request = single.build_info.pool.bytes_per_max_request
    single.shutdown()
    # room for about 2.5 full-length requests for 4 running sequences: preemption is forced;
    # 13-token steps chunk every prompt longer than that
    llm = _llm(tiny_v41, max_num_batched_tokens=13, cache_memory_gb=2.5 * per_request / 2**30, async_pipeline=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.stats().slots_used == 0
    llm.shutdown()


def test_speculative_decoding_is_refused_with_the_reason(tiny_v41, monkeypatch):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    with pytest.raises(Exception, match="DSpark draft head.*DEEPINFER_USE_NEXTN_DECODE=0"):
        _llm(tiny_v41)


@pytest.mark.slow
def test_structured_outputs_on_v41(tmp_path_factory, one_thread):
    """The real 129,280-token tokenizer (the `default` size): constrained and free requests mixed."""
    samples = load_example("_structured_output.py")
    from deepinfer.models.deepseek_v41.make_model import make_model

    path = make_model(tmp_path_factory.mktemp("v41so") / "default", "default", seed=1, dtype="float32")
    llm = _llm(str(path), max_model_len=256, max_num_batched_tokens=256, max_num_seqs=8)
    prompts, params = samples.sample_requests(max_tokens=48)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert samples.check_outputs(params, outputs, llm.tokenizer.eos_token_id) == []
    llm.shutdown()


@pytest.mark.slow
def test_conformance_kit_runs_on_a_v41_checkpoint(tiny_v41, tmp_path):
    import json

    from test_conformance import run_kit

    out = run_kit("cpu", tmp_path / "v41.json", None, f"--checkpoint={tiny_v41}", "-k",
                  "tiny_checkpoint or model_ops or hc_pre or compress_pool")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    report = json.loads((tmp_path / "v41.json").read_text())
    assert report["family"] == "deepseek_v41" and report["summary"]["failed"] == 0
    assert report["tests"]["test_tiny_checkpoint_greedy_matches_the_reference"]["outcome"] == "passed"
    assert report["tests"]["test_hc_pre_post_head"]["outcome"] == "skipped"  # V4's own op: not used by V4.1
