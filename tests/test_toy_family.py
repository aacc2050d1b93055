"""A second model family through the same engine: the test-only `toy_dense` family (tests/toy_family).

Adding it took a folder, one registry entry and its op defaults; the engine, scheduler, cache
manager, sampler and back end are DeepSeek-V4's, unchanged. Checked: greedy outputs with batching,
chunked prefill and preemption equal each request's batch-1 run and a plain-torch full-sequence
forward of the same weights; a layer that reads another layer's KV owns no memory and sees its
owner's writes; the shared, validated checkpoint reading (dequantisation, corrupt files) serves it.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from deepinfer.models.common import quant
from deepinfer.models.common.errors import CheckpointError, UnknownModelTypeError
from deepinfer.models.registry import get_model_family, load_model_checkpoint, supported_model_types
from toy_family import MODEL_TYPE, TOY_FAMILY, registered
from toy_family.checkpoint import write_checkpoint
from toy_family.config import FULL, SLIDING, ToyConfig
from toy_family.reference import reference_greedy, reference_logits
from toy_family.weights import random_weights, to_hf_names

# full (owns its KV), sliding, full reading layer 0's KV, sliding
CONFIG = ToyConfig(vocab_size=97, hidden_size=32, num_heads=4, head_dim=8, intermediate_size=64,
                   layer_types=(FULL, SLIDING, FULL, SLIDING), kv_source=(None, None, 0, None), sliding_window=5,
                   max_position_embeddings=256)


@pytest.fixture(autouse=True)
def toy_registered():
    with registered():
        yield


@pytest.fixture(scope="module")
def weights():
    return random_weights(CONFIG, seed=7)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, weights):
    return write_checkpoint(tmp_path_factory.mktemp("toy") / "ckpt", CONFIG, weights)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 3, 5, 6, 11, 17, 24, 2][:n]  # below, at and past the window (5) and the chunk (7)
    return [torch.randint(2, CONFIG.vocab_size, (k,), generator=g).tolist() for k in lengths]


def _llm(path, **kw):
    from deepinfer import LLM

    base = dict(model=str(path), accelerator="cpu", dtype="float32", max_model_len=40, max_num_seqs=4,
                max_num_batched_tokens=7, block_size=4, seed=0)
    base.update(kw)
    return LLM(**base)


def _greedy(llm, prompts, lengths):
    from deepinfer import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_through_the_engine_equals_batch_one_and_the_plain_torch_forward(checkpoint, weights, one_thread):
    prompts = _prompts(8, seed=1)
    lengths = [6 + i % 4 for i in range(len(prompts))]
    want = [reference_greedy(CONFIG, weights, p, n) for p, n in zip(prompts, lengths)]

    single = _llm(checkpoint, max_num_seqs=1, max_num_batched_tokens=64, async_pipeline=False)
    assert single.build_info.model_type == MODEL_TYPE
    alone = [_greedy(single, [p], [n])[0] for p, n in zip(prompts, lengths)]
    per_request = single.build_info.pool.bytes_per_max_request
    single.shutdown()
    assert alone == want

    # chunked prefill (7 tokens a step), up to 4 sequences a step, blocks of 4 entries, a pool of 1.5 full
    # requests: sequences are preempted and recomputed
    llm = _llm(checkpoint, cache_memory_gb=1.5 * per_request / 2**30, async_pipeline=True)
    got = _greedy(llm, prompts, lengths)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().slots_used == 0
    llm.shutdown()
    assert got == want


def test_reader_layer_owns_no_memory_and_sees_its_owners_keys(checkpoint):
    llm = _llm(checkpoint, max_num_seqs=2, async_pipeline=False)
    try:
        model = llm.engine.model
        layout = llm.engine.cache.layout
        kv = layout.group("kv")
        assert kv.tensor("k").owners == (0,) and kv.tensor("k").reader_map == {2: 0}
        assert model.cache.blocks["kv"]["k"].shape[0] == 1  # one copy for layers 0 and 2
        assert model._kv[2][0].data_ptr() == model._kv[0][0].data_ptr()
        width = CONFIG.num_heads * CONFIG.head_dim
        assert kv.bytes_per_entry() == 2 * width * 4  # k and v of ONE layer, fp32
        ring = CONFIG.sliding_window  # no speculative decoding: max_rollback 0
        assert layout.bytes_per_slot() == 2 * 2 * ring * width * 4  # two sliding layers own a ring each
        assert llm.build_info.pool.bytes_per_max_request == layout.bytes_per_slot() + 40 * kv.bytes_per_entry()
        _greedy(llm, [[5, 6, 7]], [2])
        written = model._kv[0][0][model._kv[0][0].abs().sum(-1) > 0]
        assert written.shape[0] >= 4 and torch.equal(model._kv[2][0], model._kv[0][0])
    finally:
        llm.shutdown()


def test_engine_logits_match_the_plain_torch_forward(checkpoint, weights):
    """The registry-built model on a ragged two-sequence step: logits at every row."""
    from deepinfer.models.interface import ForwardBatch, allocate_cache_tensors
    from deepinfer_plugins.cpu import CpuAccelerator

    family, config, loaded = load_model_checkpoint(checkpoint, "float32")
    assert family is TOY_FAMILY and config == CONFIG
    model = family.build_model(config, CpuAccelerator(), torch.float32, "cpu")
    model.load_weights(loaded)
    layout = model.cache_layout(0)
    model.bind_cache(allocate_cache_tensors(layout, 2, {"kv": 16}, 4, "cpu"))
    a, b = _prompts(8, seed=3)[5], _prompts(8, seed=3)[6]
    tables = torch.tensor([list(range(0, 5)) + [-1], list(range(5, 11))])
    batch = ForwardBatch(input_ids=torch.tensor(a + b), positions=torch.tensor(list(range(len(a))) + list(range(len(b)))),
                         query_lens=[len(a), len(b)], context_lens=[0, 0], slots=torch.tensor([1, 0]),
                         block_tables={"kv": tables}, logits_indices=torch.arange(len(a) + len(b)))
    logits = model.forward(batch).logits
    ref = torch.cat([reference_logits(CONFIG, weights, a), reference_logits(CONFIG, weights, b)])
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_unregistered_type_is_refused_with_the_supported_types(checkpoint):
    from toy_family.family import unregister_model_family

    unregister_model_family(MODEL_TYPE)
    assert MODEL_TYPE not in supported_model_types()
    with pytest.raises(UnknownModelTypeError, match=r"model_type 'toy_dense' is not supported; supported model "
                                                    r"types: deepseek_v4"):
        _llm(checkpoint)
    with registered():
        assert get_model_family(MODEL_TYPE) is TOY_FAMILY
        assert MODEL_TYPE in supported_model_types()


def test_quantised_toy_weights_are_dequantised_by_the_shared_loader(tmp_path, weights):
    stored = to_hf_names(weights)
    expected = dict(weights)
    for hf, name in zip(to_hf_names(weights), weights):
        if name.endswith(("attn.wq.weight", "mlp.w_up.weight")):
            q, scale = quant.quantize_fp8_block(weights[name])
            stored[hf], stored[hf[: -len(".weight")] + ".scale"] = q, scale
            expected[name] = quant.dequantize(q, scale, torch.float32)
    path = write_checkpoint(tmp_path / "fp8", CONFIG, weights, stored=stored)
    _, _, loaded = load_model_checkpoint(path, "float32")
    assert set(loaded) == set(expected)
    for name in expected:
        assert torch.equal(loaded[name], expected[name]), name
    assert not torch.equal(loaded["layers.0.attn.wq.weight"], weights["layers.0.attn.wq.weight"])  # really FP8


def test_shared_file_validation_names_a_corrupt_toy_file(checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    raw = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(raw[:-10])
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated or corrupt"):
        load_model_checkpoint(bad)


def test_missing_kernel_is_named_before_loading(checkpoint):
    class NoSwiglu:
        name = "partial"

        def linear(self, x, w):
            return x @ w.T

        def rms_norm(self, x, w, eps):
            return x

    with pytest.raises(ValueError, match=r"needs the accelerator kernels \['swiglu'\].*'partial'"):
        TOY_FAMILY.check_accelerator(NoSwiglu())


def test_config_problems_are_listed_like_v4s(tmp_path):
    bad = CONFIG.to_dict() | {"hidden_size": 0, "kv_source": [None, 0, None, None]}
    with pytest.raises(CheckpointError) as e:
        TOY_FAMILY.parse_config(bad, "toy/config.json")
    assert "toy/config.json has 2 invalid settings" in str(e.value)
    assert "hidden_size = 0 is out of range" in str(e.value) and "kv_source[1] = 0" in str(e.value)


def test_the_cpu_back_end_prepares_the_toy_decode_step(checkpoint, clean_env, monkeypatch, one_thread):
    """The toy family describes its decode step (one `_layers`, run eagerly or into a program) and nothing
    else: in bf16 the cpu back end binds the program's linears and norms to its C calls (the family has no
    cpu-plugin code), with the tokens and log-probabilities of the same program run call by call."""
    from deepinfer import SamplingParams
    from deepinfer_plugins.cpu import program

    runs = []
    run = program.PreparedProgram.run
    monkeypatch.setattr(program.PreparedProgram, "run", lambda self, *a, **kw: runs.append(self) or run(self, *a, **kw))
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)

    def generate(prepared: str):
        clean_env.setenv("DEEPINFER_CPU_DECODE_BLOCKS", prepared)
        llm = _llm(checkpoint, dtype="bfloat16", async_pipeline=False)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
                for o in outs]

    assert generate("1") == generate("0")
    assert runs, "no prepared program ran"
    bound = {}
    for s in runs[-1].steps:
        if s.binding is not None:
            bound[s.call.op] = bound.get(s.call.op, 0) + 1
    layers = len(CONFIG.layer_types)
    assert bound.get("kernels.rms_norm") == 2 * layers
    # one decode token a step at the end: its products are the C GEMV or the packed tiles, all bound
    linears = sum(1 for s in runs[-1].steps if s.call.op == "kernels.linear")
    assert runs[-1].program.key == ("decode", 1) and bound.get("kernels.linear") == linears


def test_the_toy_family_gives_its_weights_by_use(checkpoint, clean_env):
    """`load_weights` gives the back end its linears' weights: on the cpu back end their packed copies exist
    before the first step, wherever this build makes a linear's copy; the embedding (an index) has none."""
    import torch

    llm = _llm(checkpoint, dtype="bfloat16", async_pipeline=False)
    try:
        model = llm.engine.model
        kernels, probe = model.accel, torch.ones(8, 8, dtype=torch.bfloat16)
        kernels.prepare_weights([("linear", probe)])
        tables = [t for t in (kernels.packed_weights, kernels.tile_weights)
                  if t is not None and t.lookup(probe) is not None]
        if not tables:
            pytest.skip("this build keeps no copy of a linear's weight (no register tiles on its tier, no oneDNN "
                        "bf16): nothing to check")
        for table in tables:
            assert all(table.lookup(t) is not None for k, t in model.w.items() if t.dim() == 2 and k != "embed.weight")
            assert table.lookup(model.w["embed.weight"]) is None
    finally:
        llm.shutdown()
