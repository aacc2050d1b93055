"""DeepSeek-V4.1's DSpark drafter (fp32, tiny random checkpoints with `mtp.0-2`): the target features
and the drafted block (logits with the Markov bias, confidence logits) match NVIDIA NeMo AutoModel's
DSpark draft backbone on the same weights; greedy outputs are identical with speculation on and
off (fixed and variable length, both pipelines, preemption, prompts ending at CSA2 block
boundaries, rejections at every draft position); the loader and make-model carry the drafter."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer.models.deepseek_v41.checkpoint import load_checkpoint
from deepinfer.models.deepseek_v41.make_model import make_model
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.sampling_params import SamplingParams
from model_harness import Runner, accelerator, max_rel_diff

VOCAB = 512


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("v41ds") / "tiny", "tiny", seed=3, with_dspark=True)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_checkpoint(checkpoint, torch.float32)


pytestmark = pytest.mark.usefixtures("one_thread")


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _our_drafts(model, features: torch.Tensor, slot: int, anchor: int, anchor_token: int, k: int):
    """Seed positions [0, anchor) of `slot`, draft k greedily: (per-draft logits [k, V], drafts,
    confidence logits normed / residual)."""
    head = model.dspark
    head.seed_context(torch.full((anchor,), slot), torch.arange(anchor), features[:anchor])
    block = head.draft_block(torch.tensor([slot]), torch.tensor([anchor]), torch.tensor([anchor_token]))
    prev, logits, drafts, conf = torch.tensor([anchor_token]), [], [], {"normed": [], "residual": []}
    for i in range(k):
        bias, emb = head.markov(prev)
        row = block.base_logits[0, i] + bias[0]
        for kind in conf:
            head.confidence_input = kind
            conf[kind].append(head.confidence(block, i, torch.tensor([0]), emb)[0])
        logits.append(row)
        prev = row.argmax().view(1)
        drafts.append(int(prev))
    return torch.stack(logits), drafts, {kind: torch.stack(v) for kind, v in conf.items()}


@pytest.fixture(scope="module")
def nemo(checkpoint):
    pytest.importorskip("nemo_automodel", reason="NeMo AutoModel (the V4.1 oracle) is installed by "
                                                 "scripts/setup_env.sh")
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel
    from v41_oracle import build_nemo_model, nemo_config, read_release_tensors

    target = build_nemo_model(checkpoint)
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                            experts="torch", dispatcher="torch", gate_precision="float32")
    draft = DeepseekV41DSparkModel(nemo_config(checkpoint).text_config, backend, num_anchors=1,
                                   enable_confidence_head=True)
    released = {k: v for k, v in read_release_tensors(checkpoint).items()
                if k.startswith("mtp.") or k in ("embed.weight", "head.weight")}
    draft.load_state_dict(draft.state_dict_adapter.from_hf(released), strict=True)
    return target, draft.eval()


def _nemo_features(target, ids: list[int], layer_ids) -> torch.Tensor:
    captured = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: captured.__setitem__(i, args[0].mean(dim=2)))
             for i, m in zip(layer_ids, target.model.get_dspark_target_feature_modules(list(layer_ids))
                             if hasattr(target, "model") and hasattr(target.model, "get_dspark_target_feature_modules")
                             else target.get_dspark_target_feature_modules(list(layer_ids)))]
    with torch.no_grad():
        target(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.cat([captured[i] for i in layer_ids], dim=-1)[0].float()


def _nemo_block(draft, features: torch.Tensor, anchor: int, anchor_token: int, previous: list[int]):
    """NeMo's backbone on one block at `anchor` over context features [0, anchor): draft logits
    (base + Markov), confidence logits (normed input) and the final norm's input (residual)."""
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkBackbone

    c = draft.config
    S = c.dspark_block_size
    ids = torch.tensor([[anchor_token] + [c.dspark_noise_token_id] * (S - 1)])
    anchors = torch.tensor([[anchor]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    residual = {}
    hook = draft.mtp[-1].norm.register_forward_pre_hook(lambda mod, args: residual.__setitem__("x", args[0]))
    with torch.no_grad():
        out = DeepseekV41DSparkBackbone.forward(
            draft, draft.embed_tokens(ids), features[:anchor].unsqueeze(0),
            position_ids=draft.build_position_ids(anchors, anchor),
            attention_mask=draft.build_attention_mask(anchors, keep, anchor, torch.float32),
            previous_token_ids=torch.tensor([previous]))
        logits = draft.compute_logits(out.normalized_hidden_states) + out.transition_logits.float()
        emb = draft.mtp[-1].markov_head.embed(torch.tensor([previous]))
        residual_conf = draft.mtp[-1].confidence_head(residual["x"], emb)
    hook.remove()
    return logits[0], out.confidence_pred[0], residual_conf[0]


def test_draft_block_matches_nemo(loaded, nemo):
    """Target features, draft logits (base + Markov bias) and both confidence readings agree with
    NeMo's DSpark backbone, at an anchor past the window and one inside it (fewer context rows)."""
    config = loaded[0]
    target, draft = nemo
    model = DeepseekV41ForCausalLM(config, accelerator(), dtype=torch.float32)
    model.load_weights(loaded[1])
    runner = Runner(model)
    runner.add("s")
    # prompt seed 1: with seed 0, two MXFP4 index scores of a late position are within rounding of each
    # other, and the AVX-512 build's rounding on a Sapphire Rapids CPU swapped a pick (6e-4 on the features)
    tokens = _prompt(30, seed=1)
    _, streams = runner.step({"s": tokens}, return_streams=True)
    ours_f = streams["s"]
    ref_f = _nemo_features(target, tokens, config.dspark_target_layer_ids)
    assert ours_f.shape == (30, 3 * config.hidden_size)
    assert max_rel_diff(ours_f, ref_f) < 1e-4
    S = config.dspark_block_size
    for slot, anchor in ((1, 30), (2, 5)):
        anchor_token = 77
        logits, drafts, conf = _our_drafts(model, ours_f, slot, anchor, anchor_token, S)
        ref_logits, ref_conf, ref_residual_conf = _nemo_block(draft, ref_f, anchor, anchor_token,
                                                              [anchor_token] + drafts[:-1])
        assert max_rel_diff(logits, ref_logits) < 1e-3
        assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
        for a, b in zip(logits.topk(5).indices.tolist(), ref_logits.topk(5).indices.tolist()):
            assert len(set(a) & set(b)) >= 4
        assert torch.allclose(conf["normed"], ref_conf, atol=1e-3, rtol=1e-3)
        assert torch.allclose(conf["residual"], ref_residual_conf, atol=1e-3, rtol=1e-3)
        assert not torch.allclose(conf["normed"], conf["residual"])  # the two readings do differ


def test_loader_and_make_model_carry_the_drafter(checkpoint, loaded, tiny_v41, tmp_path):
    config, weights = loaded
    assert config.num_nextn_predict_layers == 3 and len(config.compress_ratios) == config.num_hidden_layers + 3
    assert weights["mtp.2.confidence_head.proj.weight"].dtype == torch.float32
    assert weights["mtp.0.main_proj.weight"].shape == (64, 192)
    model = DeepseekV41ForCausalLM(config, accelerator(), dtype=torch.float32)
    model.load_weights(weights)
    assert model.drafter_heads() == (model.dspark,) and model.drafter_unsupported is None
    # without the drafter: refused with the class's reason
    model.load_weights(load_checkpoint(tiny_v41, torch.float32)[1])
    assert model.dspark is None and "DSpark draft head" in model.drafter_unsupported
    with pytest.raises(ValueError, match="dspark_target_layer_ids = \\[9\\] must be strictly increasing"):
        make_model(tmp_path / "bad", "tiny", with_dspark=True, dspark_target_layer_ids=(9,))


# --- through the engine ---------------------------------------------------------------------------

def _llm(path, dspark=None, **kw):
    from deepinfer import LLM

    base = dict(model=str(path), accelerator="cpu", dtype="float32", max_model_len=96, max_num_seqs=4,
                max_num_batched_tokens=32, features=None if dspark is None else {"dspark": dspark})
    return LLM(**{**base, **kw})


def _run(path, prompts, params, dspark=None, **kw):
    llm = _llm(path, dspark, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = [o.outputs[0].token_ids for o in outs]
    stats, preempted = llm.engine.spec_stats, llm.engine.scheduler.num_preemptions
    llm.shutdown()
    return result, stats, preempted


def _room_for(path, dspark: dict, requests: float) -> float:
    """A cache budget (GiB) for about `requests` full-length requests: with 4 running, preemption."""
    single = _llm(path, dspark, max_num_seqs=1, max_model_len=48, block_size=4)
    per_request = single.build_info.pool.bytes_per_max_request
    single.shutdown()
    return requests * per_request / 2**30


def _batch():
    """Prompt lengths around the CSA2 block boundaries (ratio 2 and 1 groups, window 8, candidate
    blocks of 2 entries): 8, 16, 17, 24, 32 and some odd ones."""
    rng = random.Random(5)
    lengths = [8, 16, 17, 24, 32, 3, 11, 29]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=10 + i % 4, ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


@pytest.fixture(scope="module")
def reference(checkpoint):
    torch.set_num_threads(1)
    prompts, params = _batch()
    return _run(checkpoint, prompts, params)[0]


@pytest.mark.parametrize("async_pipeline", [pytest.param(False, marks=pytest.mark.slow), True])
def test_dspark_greedy_is_lossless(checkpoint, reference, async_pipeline):
    prompts, params = _batch()
    outs, stats, _ = _run(checkpoint, prompts, params, {"num_draft_tokens": 5}, async_pipeline=async_pipeline)
    assert outs == reference
    assert stats.num_drafts_verified > 0


@pytest.mark.slow
def test_dspark_variable_length_is_lossless(checkpoint, reference):
    prompts, params = _batch()
    outs, stats, _ = _run(checkpoint, prompts, params, {"num_draft_tokens": 5, "variable_length": True})
    assert outs == reference and stats.num_verifications > 0


@pytest.mark.slow
def test_rejection_at_every_position_with_preemption(checkpoint, reference):
    """The self-drafting test mode on V4.1 with a share of wrong drafts: every draft position is
    rejected somewhere; with a cache for about two requests preemption happens too."""
    prompts, params = _batch()
    dspark = {"num_draft_tokens": 4, "drafter": "self", "self_draft_error_rate": 0.3}
    outs, stats, preempted = _run(checkpoint, prompts, params, dspark,
                                  cache_memory_gb=_room_for(checkpoint, dspark, 2.5), max_num_batched_tokens=13,
                                  max_model_len=48, block_size=4)
    assert outs == reference
    assert preempted > 0
    # every position is rejected at least once, and accepted at least once
    assert all(0 < a < v for a, v in zip(stats.accepted_at[:4], stats.verified_at[:4]))
    assert stats.num_drafts_accepted < stats.num_drafts_verified


@pytest.mark.slow
def test_dspark_with_preemption_is_lossless(checkpoint, reference):
    prompts, params = _batch()
    dspark = {"num_draft_tokens": 5}
    outs, _, preempted = _run(checkpoint, prompts, params, dspark, cache_memory_gb=_room_for(checkpoint, dspark, 2.5),
                              max_num_batched_tokens=13, max_model_len=48, block_size=4, async_pipeline=True)
    assert outs == reference and preempted > 0


@pytest.mark.slow
def test_engine_drafts_equal_a_from_scratch_drafter(checkpoint, loaded, monkeypatch):
    """Every block the engine's DSpark drafter proposes (after prefill chunks, rejections and
    continuous batching) equals the block drafted from scratch: the full sequence's target features
    seeded into a fresh head, then the Markov chain. So the drafter's context rings are exact after
    every rejection, and its chaining is the head's."""
    from deepinfer_plugins.features.dspark.dspark_drafter import DSparkDrafter

    records = []
    propose = DSparkDrafter.propose

    def recording(self, requests, features):
        out = propose(self, requests, features)
        records.extend((r.request_id, r.num_tokens, d.token_ids) for r, d in zip(requests, out) if d is not None)
        return out

    monkeypatch.setattr(DSparkDrafter, "propose", recording)
    prompts, params = _batch()
    llm = _llm(checkpoint, {"num_draft_tokens": 5}, max_num_batched_tokens=13)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    sequences = {o.request_id: list(p) + list(o.outputs[0].token_ids) for o, p in zip(outs, prompts)}
    model = DeepseekV41ForCausalLM(loaded[0], accelerator(), dtype=torch.float32)
    model.load_weights(loaded[1])
    runner = Runner(model)
    features = {}
    for rid, seq in sequences.items():
        runner.add(rid)
        features[rid] = runner.step({rid: seq}, return_streams=True)[1][rid]
    checked = 0
    for rid, num_tokens, drafts in records[::3]:
        _, scratch, _ = _our_drafts(model, features[rid], 0, num_tokens - 1, sequences[rid][num_tokens - 1],
                                    len(drafts))
        assert scratch == drafts, (rid, num_tokens)
        checked += 1
    assert checked > 10


@pytest.mark.slow
def test_dspark_with_bounded_replay_is_lossless_against_replay_alone(checkpoint):
    """With SWA bounded replay (the decoder runs the last keep_tokens prompt rows; 20 is the minimum
    for 5 drafts and window 8) the target features of dropped rows are never read: greedy outputs
    with DSpark equal bounded replay without speculation."""
    prompts, params = _batch()
    replay = {"swa_replay": {"keep_tokens": 20}}
    alone = _llm(checkpoint, features=replay)
    reference = [o.outputs[0].token_ids for o in alone.generate(prompts, params, use_tqdm=False)]
    alone.shutdown()
    llm = _llm(checkpoint, features={**replay, "dspark": {"num_draft_tokens": 5}})
    assert llm.engine.model.replay_keep_tokens == 20
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.spec_stats.num_drafts_verified > 0
    llm.shutdown()
    assert outs == reference


# --- the target's state after rejections --------------------------------------------------------

def _speculate_and_reject(model, tokens: list[int], seed: int = 0) -> torch.Tensor:
    """Decode `tokens` after an 8-token prefix as speculation does: each step writes j correct and
    k - j wrong tokens (k = 1..6, every split), drops the wrong ones, then writes the correct next
    token. Returns the logits of every position from 8 on, in order."""
    rng = random.Random(seed)
    runner = Runner(model, max_rollback=6)
    runner.add("s")
    runner.step({"s": tokens[:8]})
    rows, p = [], 8
    while p < len(tokens):
        k = rng.randrange(1, 7)
        j = rng.randrange(0, min(k, len(tokens) - p) + 1)
        wrong = [(t + 1) % VOCAB for t in tokens[p + j:p + k]] + [3] * max(0, p + k - len(tokens))
        logits = runner.step({"s": tokens[p:p + j] + wrong})["s"]
        rows.append(logits[:j])
        runner.truncate("s", k - j)
        p += j
        if p < len(tokens):
            rows.append(runner.step({"s": [tokens[p]]})["s"])
            p += 1
    return torch.cat(rows)


def test_rollback_of_every_ring_entry_and_engram_history(loaded):
    """Rejected rows at every depth 1-6 across the window ring, the ratio-2 compressor slots (a group
    half written by a rejected row), the shared compressed entries the Reuse layers read from their
    owner, the index keys and the Engram n-gram history: the logits equal a full-sequence forward."""
    config, weights = loaded
    model = DeepseekV41ForCausalLM(config, accelerator(), dtype=torch.float32)
    model.load_weights(weights)
    tokens = _prompt(48, seed=2)
    full = Runner(model)
    full.add("f")
    reference = full.step({"f": tokens})["f"][8:]
    assert max_rel_diff(_speculate_and_reject(model, tokens), reference) < 1e-5


def test_mutation_rings_without_rollback_room_break_rollback(loaded, monkeypatch):
    """The same run with rings addressed as if max_rollback were 0 (a rejected row overwrites a row
    still read): the logits differ."""
    import deepinfer.models.deepseek_v41.model as v41

    real = v41.ring_sizes
    monkeypatch.setattr(v41, "ring_sizes", lambda config, max_rollback: real(config, 0))
    config, weights = loaded
    model = DeepseekV41ForCausalLM(config, accelerator(), dtype=torch.float32)
    model.load_weights(weights)
    tokens = _prompt(48, seed=2)
    monkeypatch.setattr(v41, "ring_sizes", real)
    full = DeepseekV41ForCausalLM(config, accelerator(), dtype=torch.float32)
    full.load_weights(weights)
    runner = Runner(full)
    runner.add("f")
    reference = runner.step({"f": tokens})["f"][8:]
    monkeypatch.setattr(v41, "ring_sizes", lambda config, max_rollback: real(config, 0))
    assert max_rel_diff(_speculate_and_reject(model, tokens), reference) > 1e-3
