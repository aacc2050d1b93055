"""SWA bounded replay on DeepSeek-V4.1 (the swa_replay feature, deepinfer.models.deepseek_v41.replay).

Model level (tiny V4.1, fp32, window 8, decoder = layers 4-7): the KV-source caches of a bounded
prefill equal exact prefill's bit for bit (the prepass runs on every row); the kept rows equal an
independent reference that runs the decoder on EVERY row with only its window floored (so the
row dropping, the sub-batch and the prepass are checked against a plain mask); any chunking
equals one chunk; K >= prompt length is exact prefill bit for bit; logits of a dropped row are
refused. Engine level: mode 'off' equals no feature, bit for bit; 'compact' with a large K equals
exact mode; 'compact' with a small K generates; preemption (recompute) and chunked prefill give the
same tokens; K below the minimum and a DeepSeek-V4 model are refused with the fix.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from deepinfer.models.deepseek_v41 import replay
from deepinfer.models.deepseek_v41.checkpoint import load_checkpoint
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.state import group_name
from deepinfer.sampling_params import SamplingParams
from model_harness import Runner, accelerator, max_rel_diff

PROMPT_LEN = 48  # 6 windows of 8
KEEP = 12  # >= the window (8): floor = 36, so 36 prompt rows skip the decoder


@pytest.fixture(scope="module")
def checkpoint(tiny_v41):
    return tiny_v41


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_checkpoint(checkpoint, torch.float32)


pytestmark = pytest.mark.usefixtures("one_thread")


def prompt(n: int = PROMPT_LEN, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


class ReplayRunner(Runner):
    """The model harness's runner with prompt lengths on the batch and logits at the last row only
    (what the engine asks for)."""

    def __init__(self, loaded, keep: int | None, max_rollback: int = 0):
        config, weights = loaded
        model = DeepseekV41ForCausalLM(config, accelerator(), dtype=torch.float32)
        model.load_weights(weights)
        super().__init__(model, max_rollback=max_rollback)
        model.set_bounded_replay(keep)
        self.prompt_lens: dict = {}

    def batch(self, chunks, return_streams=False, logits=True):
        b = super().batch(chunks, return_streams)
        b.prompt_lens = [self.prompt_lens[k] for k in chunks]
        ends = torch.cumsum(torch.tensor(b.query_lens), 0) - 1
        b.logits_indices = ends if logits else ends[:0]
        return b

    def run(self, tokens: list[int], chunks: list[int], new_tokens: int = 4) -> torch.Tensor:
        """Prefill in `chunks`, then greedy decode: the last row's logits of the prompt and of each
        decode step `[1 + new_tokens, V]` (as the engine, no logits for the other chunks)."""
        self.add("s")
        self.prompt_lens["s"] = len(tokens)
        out, i = [], 0
        for j, n in enumerate(chunks):
            logits = self.model.forward(self.batch({"s": tokens[i:i + n]}, logits=j == len(chunks) - 1)).logits
            self.seqs["s"].length += n
            i += n
        out.append(logits[-1])
        assert i == len(tokens)
        for _ in range(new_tokens):
            t = int(out[-1].argmax())
            out.append(self.model.forward(self.batch({"s": [t]})).logits[-1])
            self.seqs["s"].length += 1
        return torch.stack(out)

    def entries(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV source `layer`'s first n (compressed KV, index keys) entries of the sequence (via its block table)."""
        st, bs = self.model.blocks[layer].attn.state, self.block_size
        blocks = self.seqs["s"].blocks[group_name(self.model.config.compress_ratio(layer))]
        rows = torch.tensor([blocks[e // bs] * bs + e % bs for e in range(n)])
        return st.entries[rows], st.index_keys[rows]


def _decoder_window(runner: ReplayRunner, layer: int, positions: range) -> torch.Tensor:
    ring = runner.model.blocks[layer].attn.state.window[runner.seqs["s"].slot]
    return ring[[p % ring.shape[0] for p in positions]]


# ----- model level -----

def test_kv_source_caches_equal_exact_prefill(loaded):
    """The prepass runs the decoder KV source's compressor on every row; the encoder runs every row."""
    tokens = prompt()
    exact, bounded = ReplayRunner(loaded, None), ReplayRunner(loaded, KEEP)
    exact.run(tokens, [PROMPT_LEN], new_tokens=0)
    bounded.run(tokens, [PROMPT_LEN], new_tokens=0)
    config = loaded[0]
    for layer in config.kv_source_layer_ids:
        n = PROMPT_LEN // config.compress_ratio(layer)
        for e, b in zip(exact.entries(layer, n), bounded.entries(layer, n)):
            assert torch.equal(e, b), layer
    cut = replay.decoder_start(config)
    for layer in range(cut):  # encoder rings: exact
        assert torch.equal(_decoder_window(exact, layer, range(40, 48)), _decoder_window(bounded, layer, range(40, 48)))
    # decoder rings come from the kept rows only: they differ (bounded replay is approximate)
    assert not torch.equal(_decoder_window(exact, cut + 1, range(40, 48)),
                           _decoder_window(bounded, cut + 1, range(40, 48)))


def _floored_reference(monkeypatch):
    """Bounded replay computed without dropping any row: the decoder runs every row of the step,
    with its window keys floored at max(0, prompt_len - K) (the independent reference)."""
    original = replay.decoder_rows

    def every_row(batch, config, keep):
        split = original(batch, config, keep)
        if split is None:
            return None
        T = int(batch.input_ids.numel())
        floors = [max(0, p - keep) for p in batch.prompt_lens]
        rows = torch.arange(T)
        return replay.DecoderRows(split.layer, rows, rows.clone(), batch, floors)

    monkeypatch.setattr("deepinfer.models.deepseek_v41.model.decoder_rows", every_row)


def test_kept_rows_equal_a_window_floored_full_decoder(loaded, monkeypatch):
    tokens = prompt()
    exact = ReplayRunner(loaded, None).run(tokens, [PROMPT_LEN])
    bounded = ReplayRunner(loaded, KEEP).run(tokens, [PROMPT_LEN])
    _floored_reference(monkeypatch)
    reference = ReplayRunner(loaded, KEEP).run(tokens, [PROMPT_LEN])
    assert max_rel_diff(bounded, reference) < 1e-5
    assert max_rel_diff(bounded, exact) > 1e-3  # the approximation is real at this K


@pytest.mark.parametrize("chunks", [[5, 7, 1, 20, 15], [36, 12], [35, 2, 11], [40, 8], [8] * 6])
def test_chunked_prefill_equals_one_chunk(loaded, chunks):
    tokens = prompt()
    whole = ReplayRunner(loaded, KEEP).run(tokens, [PROMPT_LEN])
    chunked = ReplayRunner(loaded, KEEP).run(tokens, chunks)
    assert max_rel_diff(chunked, whole) < 1e-5


def test_keep_at_least_the_prompt_is_exact_prefill(loaded):
    tokens = prompt()
    exact = ReplayRunner(loaded, None).run(tokens, [20, 28])
    assert torch.equal(ReplayRunner(loaded, PROMPT_LEN).run(tokens, [20, 28]), exact)


def test_logits_of_a_dropped_row_are_refused(loaded):
    runner = ReplayRunner(loaded, KEEP)
    runner.add("s")
    runner.prompt_lens["s"] = PROMPT_LEN
    batch = runner.batch({"s": prompt()})
    batch.logits_indices = torch.tensor([3, PROMPT_LEN - 1])
    with pytest.raises(ValueError, match="does not run through the decoder.*TRUNCATION_MODE=off"):
        runner.model.forward(batch)


def test_model_refuses_keep_below_window_plus_backtrack(loaded):
    runner = ReplayRunner(loaded, None, max_rollback=6)  # verify width 6: minimum 8 + 12 = 20
    with pytest.raises(ValueError, match="minimum 20"):
        runner.model.set_bounded_replay(19)
    runner.model.set_bounded_replay(20)


# ----- the feature plugin -----

def test_plugin_refuses_keep_below_the_minimum_and_names_it(loaded):
    from deepinfer_plugins.features.swa_replay import SwaReplayConfig, SwaReplayPlugin

    runner = ReplayRunner(loaded, None, max_rollback=6)
    engine = SimpleNamespace(model=runner.model, cache=SimpleNamespace(layout=runner.layout))
    with pytest.raises(ValueError, match=r"KEEP_TOKENS=19 is below the minimum 20 .*set "
                                         r"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=20"):
        SwaReplayPlugin(SwaReplayConfig(keep_tokens=19)).deepinfer_engine_start(engine)
    SwaReplayPlugin(SwaReplayConfig(keep_tokens=20)).deepinfer_engine_start(engine)
    assert runner.model.replay_keep_tokens == 20


def _llm(path, **kw):
    from deepinfer import LLM

    base = dict(model=str(path), accelerator="cpu", dtype="float32", max_model_len=96, max_num_seqs=4,
                max_num_batched_tokens=64)
    return LLM(**{**base, **kw})


def _generate(path, prompts, max_tokens=6, **kw):
    llm = _llm(path, **kw)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    keep = llm.engine.model.replay_keep_tokens
    preemptions = llm.engine.scheduler.num_preemptions
    per_request = llm.build_info.pool.bytes_per_max_request
    llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [o.outputs[0].logprobs for o in outs]
    return SimpleNamespace(tokens=tokens, logprobs=logprobs, keep=keep, preemptions=preemptions,
                           per_request=per_request)


@pytest.fixture(scope="module")
def engine_prompts():
    return [prompt(n, seed=n) for n in (60, 33, 11, 47)]


@pytest.fixture(scope="module")
def exact_run(checkpoint, engine_prompts):
    return _generate(checkpoint, engine_prompts)


def test_mode_off_is_no_feature_bit_for_bit(checkpoint, engine_prompts, exact_run, monkeypatch):
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "off")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "8")
    off = _generate(checkpoint, engine_prompts)
    assert off.keep is None
    assert off.tokens == exact_run.tokens and off.logprobs == exact_run.logprobs


def test_compact_with_keep_at_least_the_prompt_is_exact(checkpoint, engine_prompts, exact_run, monkeypatch):
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "60")
    run = _generate(checkpoint, engine_prompts)
    assert run.keep == 60
    assert run.tokens == exact_run.tokens and run.logprobs == exact_run.logprobs


@pytest.mark.slow
def test_compact_small_keep_generates_and_chunking_and_preemption_do_not_change_it(checkpoint):
    prompts = [prompt(n, seed=n) for n in (40, 33, 11, 37, 39, 25, 30, 18)]
    common = dict(max_model_len=80, max_tokens=6)
    exact = _generate(checkpoint, prompts, max_num_seqs=1, max_num_batched_tokens=96, **common)
    features = {"swa_replay": {"keep_tokens": 10}}
    whole = _generate(checkpoint, prompts, features=features, max_num_seqs=1, max_num_batched_tokens=96, **common)
    assert whole.keep == 10 and all(len(t) == 6 for t in whole.tokens)
    assert whole.tokens != exact.tokens  # up to 30 of a prompt's rows skip the decoder
    # 13-token steps chunk every prompt; a pool for about 2.5 requests at 4 running sequences preempts
    squeezed = _generate(checkpoint, prompts, features=features, max_num_batched_tokens=13,
                         cache_memory_gb=2.5 * whole.per_request / 2**30, async_pipeline=True, **common)
    assert squeezed.preemptions > 0
    assert squeezed.tokens == whole.tokens


def test_keep_below_the_window_is_refused_at_engine_start(checkpoint, monkeypatch):
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "7")
    with pytest.raises(Exception, match=r"below the minimum 8 \(sliding_window 8 \(no speculative decoding\)\); "
                                        r"set DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=8"):
        _llm(checkpoint)


def test_deepseek_v4_is_refused(tiny_v4, monkeypatch):
    path = tiny_v4
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    with pytest.raises(Exception, match="needs a DeepSeek-V4.1 model.*TRUNCATION_MODE=off"):
        _llm(path)


def test_benchmark_yoco_clip_turns_the_feature_on_and_refuses_mode_off(monkeypatch):
    from example_modules import load_example

    benchmark = load_example("benchmark.py")
    benchmark.check_yoco_clip(True)  # the feature is installed in-tree
    args = benchmark.build_parser().parse_args(["--yoco_clip"])
    assert args.yoco_clip
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "off")
    with pytest.raises(ValueError, match="--yoco_clip turns SWA bounded replay on.*=off"):
        benchmark.check_yoco_clip(True)
    benchmark.check_yoco_clip(False)
