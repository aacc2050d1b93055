"""Our DeepSeek-V4 (fp32, CPU kernels) against transformers' DeepseekV4ForCausalLM, the oracle
(docs/model.md, "Verification"): logits at every prefill and decode step against the uncached HF forward,
greedy continuations, chunking / batch / rollback invariance of the engine-managed state."""
from __future__ import annotations

import random

import pytest
import torch

from model_harness import Runner, build_hf_model, build_our_model, hf_logits, max_rel_diff
from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING

TOL = 1e-4  # relative to the logit scale; measured agreement is ~2e-6 (docs/model.md)
SAME = 2e-5  # two runs of our model that differ only in batching/chunking

CONFIGS = {
    # [sliding, CSA, HCA, CSA, HCA, sliding], hash + learned MoE, YaRN
    "tiny": {},
    # HCA first, larger window, rate-8 HCA, no YaRN, top-3 indexer, sigmoid router
    "hca8": dict(num_hidden_layers=4, layer_types=[HCA, CSA, SLIDING, HCA], mlp_layer_types=["hash_moe"] + ["moe"] * 3,
                 sliding_window=12, compress_rates={CSA: 4, HCA: 8}, index_topk=3, rope_parameters=None,
                 scoring_func="sigmoid", num_experts_per_tok=3),
}


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    # tiny ops: OpenMP threads only add contention on a loaded 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name: str, query_block: int = 256):
        if name not in cache:
            cache[name] = build_hf_model(seed=len(cache), **CONFIGS[name])
        hf = cache[name]
        return hf, build_our_model(hf, query_block=query_block)
    return get


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_and_greedy_decode_match_hf(models, name):
    """A prompt longer than the window and several HCA windows, then 64 greedy tokens: the
    logits at every position match HF's uncached forward and every greedy pick is HF's argmax."""
    hf, ours = models(name)
    p = prompt(37, seed=1)
    tokens, logits = Runner(ours).generate("s", p, new_tokens=64)
    ref = hf_logits(hf, tokens)
    assert max_rel_diff(logits, ref) < TOL
    picks = torch.tensor(tokens[len(p):])
    assert torch.equal(ref[len(p) - 1:-1].argmax(-1), picks), "greedy continuation differs from HF"


def test_short_prompts_decode_through_the_first_boundaries(models):
    """Prompts of 1, 3, 4 and 5 tokens: decode starts with no compressed entry and crosses the first
    CSA (4), window (8) and HCA (16) boundaries."""
    hf, ours = models("tiny")
    for n in (1, 3, 4, 5):
        tokens, logits = Runner(ours).generate("s", prompt(n, seed=20 + n), new_tokens=18)
        assert max_rel_diff(logits, hf_logits(hf, tokens)) < TOL, f"prompt of {n}"


def test_chunked_prefill_matches_single_prefill_and_hf(models):
    """Odd chunk sizes (crossing window, CSA and HCA boundaries inside and between chunks; query
    blocks of 8) then decode == one prefill then decode == HF."""
    hf, ours = models("tiny", query_block=8)
    p = prompt(48, seed=2)
    tok_a, log_a = Runner(ours).generate("a", p, 20, chunk_sizes=[5, 3, 7, 1, 9, 2, 6, 11, 4])
    tok_b, log_b = Runner(ours).generate("b", p, 20)
    assert tok_a == tok_b
    assert max_rel_diff(log_a, log_b) < SAME
    assert max_rel_diff(log_a, hf_logits(hf, tok_a)) < TOL


def test_ragged_batch_matches_each_sequence_alone(models):
    """Sequences of different lengths in one batch, prefill chunks mixed with decode tokens,
    == each sequence run alone (and == HF)."""
    hf, ours = models("tiny")
    prompts = {"a": prompt(30, 3), "b": prompt(13, 4), "c": prompt(50, 5)}
    alone = {k: Runner(ours).generate(k, p, 12) for k, p in prompts.items()}

    r = Runner(ours, num_slots=4)
    for k in prompts:
        r.add(k)
    tokens = {k: list(p) for k, p in prompts.items()}
    fed = {k: 0 for k in prompts}
    logits = {k: [] for k in prompts}
    rng = random.Random(0)
    while any(len(tokens[k]) < len(prompts[k]) + 12 or fed[k] < len(tokens[k]) for k in prompts):
        step = {}
        for k in prompts:
            if fed[k] < len(prompts[k]):  # still in prefill: a random chunk
                n = min(rng.randint(1, 17), len(prompts[k]) - fed[k])
                step[k] = tokens[k][fed[k]:fed[k] + n]
            elif fed[k] < len(tokens[k]):
                step[k] = tokens[k][fed[k]:]
        out = r.step(step)
        for k, lg in out.items():
            fed[k] += len(step[k])
            logits[k].append(lg)
            if fed[k] >= len(prompts[k]) and len(tokens[k]) < len(prompts[k]) + 12:
                tokens[k].append(int(lg[-1].argmax()))
    for k in prompts:
        got = torch.cat(logits[k])
        ref_tokens, ref_logits = alone[k]
        assert tokens[k] == ref_tokens
        assert max_rel_diff(got, ref_logits[:len(got)]) < SAME
        assert max_rel_diff(got, hf_logits(hf, tokens[k])[:len(got)]) < TOL


def test_rollback_is_exact_across_compression_boundaries(models):
    """Write k draft tokens (single steps and a multi-token verify step), drop some by setting the
    length back, continue: identical to never having written them, across CSA (4) and HCA (16)
    window boundaries and beyond the window."""
    hf, ours = models("tiny")
    p = prompt(29, seed=6)
    cont = prompt(40, seed=7)
    ref_tokens = p + cont
    ref = Runner(ours)
    ref.add("s")
    ref_logits = torch.cat([ref.step({"s": p})["s"]] + [ref.step({"s": [t]})["s"] for t in cont])

    r = Runner(ours, max_rollback=6)
    r.add("s")
    got = [r.step({"s": p})["s"]]
    rng = random.Random(1)
    i = 0
    while i < len(cont):
        if rng.random() < 0.5:
            # verify step: the true token plus up to 5 junk drafts in one chunk, keep j of them
            drafts = [cont[i]] + [rng.randrange(2, 512) for _ in range(rng.randint(1, 5))]
            accept = 1
            while accept < len(drafts) and i + accept < len(cont) and rng.random() < 0.5:
                drafts[accept] = cont[i + accept]
                accept += 1
            out = r.step({"s": drafts})["s"]
            r.truncate("s", len(drafts) - accept)
            got.append(out[:accept])
            i += accept
        else:
            # junk tokens one at a time, rolled back, then the true token
            junk = [rng.randrange(2, 512) for _ in range(rng.randint(1, 6))]
            for t in junk:
                r.step({"s": [t]})
            r.truncate("s", len(junk))
            got.append(r.step({"s": [cont[i]]})["s"])
            i += 1
    got = torch.cat(got)
    assert max_rel_diff(got, ref_logits) < SAME
    assert max_rel_diff(got, hf_logits(hf, ref_tokens)) < TOL


def _random_mtp_weights(config, seed: int) -> dict[str, torch.Tensor]:
    from deepinfer.models.deepseek_v4.weights import expected_weight_shapes, weight_kind
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_weight_shapes(config).items():
        if not name.startswith("mtp.0."):
            continue
        t = torch.randn(shape, generator=gen)
        if name.endswith("attn_sink"):
            pass
        elif name.endswith("norm.weight"):
            t = 1.0 + 0.2 * t
        elif name.endswith("_scale"):
            t = 1.0 + 0.3 * t
        elif name.endswith("_base"):
            t = 0.5 * t
        elif name.endswith("gate.bias"):
            t = 0.1 * t
        else:
            t = 0.1 * t
        out[name] = t if weight_kind(name) != "int" else t.long()
    return out


@torch.no_grad()
def _hf_mtp_reference(hf, weights, streams, next_ids):
    """The MTP block (docs/model.md, "MTP") built from HF's own modules, run uncached."""
    from transformers import DeepseekV4Config as HFConfig
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M
    from deepinfer.models.deepseek_v4.weights import to_hf_names
    cfg = HFConfig(**{**hf.config.to_dict(), "num_hidden_layers": 1, "layer_types": [SLIDING],
                      "mlp_layer_types": ["moe"]})
    layer = M.DeepseekV4DecoderLayer(cfg, 0).eval()
    block = {k.replace("mtp.0.", "layers.0.", 1): v for k, v in weights.items()
             if k.startswith("mtp.0.") and k.split(".")[2] in ("attn", "ffn", "attn_norm", "ffn_norm")
             or k.startswith("mtp.0.hc_attn") or k.startswith("mtp.0.hc_ffn")}
    hf_block = {k[len("model.layers.0."):]: v for k, v in to_hf_names(block).items()}
    layer.load_state_dict(hf_block, strict=True)
    rms = lambda x, w: w * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)  # noqa: E731
    w = {k[len("mtp.0."):]: v for k, v in weights.items() if k.startswith("mtp.0.")}
    e = rms(hf.model.embed_tokens.weight[next_ids], w["enorm.weight"]) @ w["e_proj.weight"].T
    x = (e.unsqueeze(1) + rms(streams, w["hnorm.weight"]) @ w["h_proj.weight"].T).unsqueeze(0)
    S = x.shape[1]
    pos = torch.arange(S).unsqueeze(0)
    rot = M.DeepseekV4RotaryEmbedding(cfg)
    pe = {k: rot(x, pos, layer_type=k) for k in ("main", "compress")}
    i, j = torch.arange(S).unsqueeze(1), torch.arange(S).unsqueeze(0)
    mask = torch.where((j <= i) & (j > i - cfg.sliding_window), 0.0, float("-inf")).view(1, 1, S, S)
    out = layer(x, input_ids=next_ids.unsqueeze(0), position_embeddings=pe, position_ids=pos, attention_mask=mask)
    head = M.DeepseekV4HyperHead(cfg)
    head.load_state_dict({"hc_fn": w["hc_head_fn"], "hc_base": w["hc_head_base"], "hc_scale": w["hc_head_scale"]})
    h = rms(head(out)[0], w["norm.weight"])
    return h @ hf.lm_head.weight.T


def test_mtp_block_matches_hf_modules(models):
    """mtp_forward over chunks and single positions == the MTP block assembled from HF's decoder
    layer / hyper-head modules (HF itself has no MTP), run uncached."""
    from deepinfer.models.interface import ForwardBatch
    hf, _ = models("tiny")
    mtp = _random_mtp_weights(build_our_model(hf).config, seed=11)
    ours = build_our_model(hf, extra=mtp)
    tokens = prompt(40, seed=8)
    r = Runner(ours)
    r.add("s")
    _, streams = r.step({"s": tokens}, return_streams=True)
    streams = streams["s"][:-1]
    next_ids = torch.tensor(tokens[1:])
    ref = _hf_mtp_reference(hf, mtp, streams, next_ids)

    slot = r.seqs["s"].slot
    got, t = [], 0
    for n in [5, 9, 1, 1, 3, 12] + [1] * 8:
        batch = ForwardBatch(input_ids=next_ids[t:t + n], positions=torch.arange(t, t + n), query_lens=[n],
                             context_lens=[t], slots=torch.tensor([slot]), block_tables={},
                             logits_indices=torch.arange(n))
        got.append(ours.mtp_forward(streams[t:t + n], next_ids[t:t + n], batch).logits)
        t += n
    assert t == len(next_ids)
    assert max_rel_diff(torch.cat(got), ref) < TOL


def test_bf16_runs_with_fp32_state_and_logits(models):
    """bf16 has no exact oracle (transformers' own bf16 differs from its fp32); check dtypes and
    that it tracks fp32 closely at the first positions (before routing flips can compound)."""
    hf, fp32 = models("tiny")
    bf16 = build_our_model(hf, dtype=torch.bfloat16)
    p = prompt(20, seed=9)
    r = Runner(bf16)
    r.add("s")
    lg = r.step({"s": p})["s"]
    assert lg.dtype == torch.float32 and torch.isfinite(lg).all()
    assert r.model.blocks[1].attn.state.rows[0].dtype == torch.float32  # compressor rows stay fp32
    assert r.model.blocks[1].attn.state.window.dtype == torch.bfloat16
    ref = hf_logits(hf, p)
    assert max_rel_diff(lg[:4], ref[:4]) < 0.05


def test_bad_batches_are_refused(models):
    from deepinfer.models.interface import ForwardBatch
    _, ours = models("tiny")
    r = Runner(ours)
    r.add("s")
    good = r.batch({"s": [5, 6, 7]})
    bad = ForwardBatch(**{**good.__dict__, "positions": torch.tensor([3, 4, 5])})
    with pytest.raises(ValueError, match="positions"):
        ours.forward(bad)
    bad = ForwardBatch(**{**good.__dict__, "slots": torch.tensor([99])})
    with pytest.raises(ValueError, match="slots"):
        ours.forward(bad)
    r.seqs["s"].length = 40  # 10 CSA entries but no blocks allocated for them
    bad = ForwardBatch(**{**good.__dict__, "positions": torch.arange(40, 43), "context_lens": [40]})
    with pytest.raises(ValueError, match="block table"):
        ours.forward(bad)
