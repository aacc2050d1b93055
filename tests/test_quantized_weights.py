"""Quantised weights kept quantised in memory (`QuantizedWeight`, `Capabilities.weight_formats`).

The format objects (exact dequantisation, row slices, concatenation, grouping), the reference and
cpu kernels on them (tile by tile, equal to the dequantised weights), the loader (which weights stay
quantised, their bytes), the models (fp32 logits and greedy tokens equal to the dequantise-at-load
path on tiny V4 FP8 + FP4-expert and V4.1 FP8 32x32 + FP4-expert checkpoints), the engine
(`DEEPINFER_CPU_QUANTIZED_WEIGHTS=1`), and that a back end never receives a format it does not
declare.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.accelerator.interface import Capabilities
from deepinfer.accelerator.quantized_weight import (
    FP4_E2M1, FP8_BLOCK32, FP8_BLOCK128, QuantizedWeight, can_cat_rows, cat_rows, stack,
)
from deepinfer.accelerator.reference import TorchKernels, quantized_linear
from deepinfer.models.common import quant
from deepinfer.models.common.weights import concat_rows, fuse_experts, fuse_rows, group_rows
from model_harness import Runner, max_rel_diff

REF = TorchKernels()
V4_FORMATS = (FP8_BLOCK128, FP4_E2M1)
V41_FORMATS = (FP8_BLOCK32, FP4_E2M1)


def _representable(shape: tuple[int, ...], seed: int, fp4: bool) -> torch.Tensor:
    """Values a format holds exactly (codes times powers of two), so quantise -> dequantise is exact
    and any misplaced code or scale shows."""
    g = torch.Generator().manual_seed(seed)
    if fp4:
        codes = torch.tensor(quant.FP4_E2M1_VALUES)[torch.randint(0, 8, shape, generator=g)]
        codes = codes * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
        # one power of two per group of 32 inputs, with the group's max code present (6.0)
        codes.view(*shape[:-1], -1, 32)[..., 0] = 6.0
        exps = torch.randint(-3, 4, (*shape[:-1], shape[-1] // 32), generator=g).float()
        return codes * torch.exp2(exps).repeat_interleave(32, dim=-1)
    x = torch.randn(shape, generator=g)
    return x.to(torch.float8_e4m3fn).float()


def _fp8(w: torch.Tensor, block: int) -> QuantizedWeight:
    data, scale = quant.quantize_fp8_block(w, block)
    return QuantizedWeight(data, scale, block, torch.float32)


def _fp4(w: torch.Tensor) -> QuantizedWeight:
    data, scale = quant.quantize_fp4(w)
    return QuantizedWeight(data, scale, 32, torch.float32)


# ----------------------------------------------------------------------------- the weight object

def test_fp4_dequantises_exactly_with_the_low_nibble_first():
    w = _representable((6, 64), 0, fp4=True)
    q = _fp4(w)
    assert q.format == FP4_E2M1 and tuple(q.shape) == (6, 64) and q.data.shape == (6, 32)
    assert torch.equal(q.dequantize(), w)
    # the element order inside a byte, checked on one hand-made byte: low nibble 0x2 (1.0) is the even
    # element, high nibble 0xB (-1.5) the odd one
    one = QuantizedWeight(torch.full((1, 16), 0xB2, dtype=torch.uint8).view(torch.int8),
                          torch.ones(1, 1).to(torch.float8_e8m0fnu), 32, torch.float32)
    assert one.dequantize()[0, :2].tolist() == [1.0, -1.5]
    assert q.nbytes == 6 * 32 + 6 * 2


@pytest.mark.parametrize("block", [32, 128])
def test_fp8_block_dequantises_exactly_and_slices_on_block_rows(block):
    rows = 2 * block + block // 2  # a partial last block of rows and of columns
    # rows scaled by different powers of two: each block gets its own scale
    w = _representable((rows, block + 8), 1, fp4=False) * torch.linspace(0, 4, rows).round().exp2().unsqueeze(1)
    q = _fp8(w, block)
    assert q.format == f"fp8_block{block}"
    assert torch.equal(q.dequantize(), w)
    assert torch.equal(q.rows(block, rows).dequantize(), w[block:])
    assert torch.equal(q.rows(0, block + 3).dequantize(), w[:block + 3])
    with pytest.raises(ValueError, match="multiple of"):
        q.rows(3, rows)  # a slice starting inside a scale block has no scale rows of its own
    tiles = q.row_tiles(max_elements=(block + 8) * block)
    assert tiles == [(0, block), (block, 2 * block), (2 * block, rows)]


def test_construction_checks_every_shape_and_dtype():
    data, scale = quant.quantize_fp8_block(torch.randn(64, 64), 32)
    with pytest.raises(ValueError, match="scale shape"):
        QuantizedWeight(data, scale[:, :1], 32, torch.bfloat16)
    with pytest.raises(ValueError, match="ue8m0"):
        QuantizedWeight(data, scale.to(torch.bfloat16), 32, torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        QuantizedWeight(torch.zeros(64, 64), scale, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="stands for"):
        QuantizedWeight(data, scale, 32, torch.int8)
    with pytest.raises(ValueError, match="unknown weight formats"):
        Capabilities(name="x", device_type="cpu", weight_formats=("fp8",))
    assert Capabilities(name="x", device_type="cpu", weight_formats=("fp8_block64",)).weight_formats


def test_concatenation_stacking_and_grouping_stay_quantised_when_aligned():
    a, b = _representable((64, 64), 2, fp4=False), _representable((40, 64), 3, fp4=False)
    qa, qb = _fp8(a, 32), _fp8(b, 32)
    fused = cat_rows([qa, qb])  # 64 rows = two whole blocks, then the rest
    assert torch.equal(fused.dequantize(), torch.cat([a, b]))
    assert not can_cat_rows([qb, qa])  # 40 rows: the second part would start inside a block
    plain = concat_rows([qb, qa])  # ... so it is dequantised and concatenated as plain rows
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, torch.cat([b, a]))
    assert isinstance(concat_rows([qa, a]), torch.Tensor)  # mixed with a plain part: plain
    grouped = group_rows(qa, 2)
    assert isinstance(grouped, QuantizedWeight) and tuple(grouped.shape) == (2, 32, 64)
    assert torch.equal(grouped[1].dequantize(), a[32:])
    assert not qa.can_unflatten_rows(4)  # groups of 16 rows: not whole 32-row blocks
    e = [_representable((8, 64), 10 + i, fp4=True) for i in range(3)]
    experts = stack([_fp4(x) for x in e])
    assert tuple(experts.shape) == (3, 8, 64) and torch.equal(experts[2].dequantize(), e[2])


def test_fuse_rows_and_fuse_experts_keep_quantised_parts_as_row_views():
    w1, w3, w2 = (_representable(s, 20 + i, fp4=True) for i, s in enumerate([(32, 64), (32, 64), (64, 32)]))
    w = {"x.a.weight": _fp8(_representable((64, 64), 4, fp4=False), 32),
         "x.b.weight": _fp8(_representable((32, 64), 5, fp4=False), 32)}
    want = torch.cat([w["x.a.weight"].dequantize(), w["x.b.weight"].dequantize()])
    fuse_rows(w, "x.fused.weight", ("x.a.weight", "x.b.weight"))
    assert isinstance(w["x.fused.weight"], QuantizedWeight) and torch.equal(w["x.fused.weight"].dequantize(), want)
    assert torch.equal(w["x.b.weight"].dequantize(), want[64:])  # a row view of the fused weight
    e = {f"ffn.experts.{i}.{k}.weight": _fp4(t) for i in range(2) for k, t in (("w1", w1), ("w3", w3), ("w2", w2))}
    fuse_experts(e, 2)
    assert set(e) == {"ffn.experts.w13", "ffn.experts.w2"}
    assert torch.equal(e["ffn.experts.w13"][1].dequantize(), torch.cat([w1, w3]))
    assert torch.equal(e["ffn.experts.w2"][0].dequantize(), w2)


# ------------------------------------------------------------------------------------- kernels

def _kernels():
    from deepinfer_plugins.cpu.accelerator import CpuAccelerator
    from deepinfer_plugins.cpu.kernels import CpuKernels

    return [REF, CpuKernels(), CpuAccelerator()]


@pytest.mark.parametrize("kernels", _kernels(), ids=["reference", "cpu-torch", "cpu-native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_on_quantised_weights_equal_the_dequantised_ones(kernels, dtype):
    g = torch.Generator().manual_seed(7)
    q8 = _fp8(torch.randn(96, 64, generator=g), 32)
    x = torch.randn(3, 5, 64, generator=g).to(dtype)
    want = kernels.linear(x, q8.dequantize(dtype))
    torch.testing.assert_close(kernels.linear(x, q8), want, rtol=1e-5, atol=1e-5)
    one = x[:1, :1]  # the decode-sized path
    torch.testing.assert_close(kernels.linear(one, q8), kernels.linear(one, q8.dequantize(dtype)), rtol=1e-5, atol=1e-5)
    # several tiles: each tile's columns are those of the whole product
    tiled = quantized_linear(x, q8, kernels.linear, max_elements=32 * 64)
    torch.testing.assert_close(tiled, want, rtol=1e-5, atol=1e-5)

    grouped = _fp8(torch.randn(64, 48, generator=g), 32).unflatten_rows(2)  # [2, 32, 48]
    xg = torch.randn(4, 2, 48, generator=g).to(dtype)
    torch.testing.assert_close(kernels.grouped_linear(xg, grouped),
                               kernels.grouped_linear(xg, grouped.dequantize(dtype)), rtol=1e-5, atol=1e-5)

    E, D, inter = 4, 64, 32
    w13 = stack([_fp4(torch.randn(2 * inter, D, generator=g)) for _ in range(E)])
    w2 = stack([_fp4(torch.randn(D, inter, generator=g) * 0.2) for _ in range(E)])
    ids = torch.tensor([[0, 2], [2, 3], [0, 2], [3, 0], [2, 0]])  # expert 1 has no rows
    rows, plan = kernels.moe_dispatch(torch.randn(5, D, generator=g).to(dtype), ids, E)
    want = kernels.moe_experts(rows, plan, w13.dequantize(dtype), w2.dequantize(dtype), 7.0).float()
    # in bf16 the back end's fused expert kernel rounds its intermediates differently from the
    # per-expert products the quantised path runs; in fp32 both are the same product
    close = 1e-5 if dtype == torch.float32 else 1e-2
    for got in (kernels.moe_experts(rows, plan, w13, w2, 7.0),
                kernels.moe_experts(rows, plan, w13, w2.dequantize(dtype), 7.0)):  # one plain: allowed
        assert float((got.float() - want).norm() / want.norm()) < close


def test_experts_dequantise_only_the_experts_that_have_rows(monkeypatch):
    E, D, inter = 4, 32, 32
    g = torch.Generator().manual_seed(8)
    w13 = stack([_fp4(torch.randn(2 * inter, D, generator=g)) for _ in range(E)])
    w2 = stack([_fp4(torch.randn(D, inter, generator=g)) for _ in range(E)])
    rows, plan = REF.moe_dispatch(torch.randn(3, D, generator=g), torch.tensor([[1, 3], [3, 1], [1, 3]]), E)
    seen = []
    original = QuantizedWeight.dequantize

    def spy(self, dtype=None):
        seen.append(tuple(self.shape))
        return original(self, dtype)

    monkeypatch.setattr(QuantizedWeight, "dequantize", spy)
    REF.moe_experts(rows, plan, w13, w2, 0.0)
    assert seen == [(2 * inter, D), (D, inter)] * 2  # experts 1 and 3, one matrix at a time


# ------------------------------------------------------------------------------ checkpoints, models

@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    from deepinfer.models.deepseek_v4.make_model import make_model

    return make_model(tmp_path_factory.mktemp("qw") / "v4", "tiny", seed=3, quantize="fp4-experts")


@pytest.fixture(scope="module")
def v41_path(tiny_v41):
    return tiny_v41  # its FP4 experts and FP8 linears are the release format's


FAMILIES = [("v4_path", V4_FORMATS), ("v41_path", V41_FORMATS)]


def _load(path, formats, dtype=torch.float32):
    from deepinfer.models.registry import checkpoint_family

    family, config_dict = checkpoint_family(path)
    config, weights = family.load_checkpoint(path, dtype, config_dict, weight_formats=formats)
    return family, config, weights


@pytest.mark.parametrize("fixture, formats", FAMILIES, ids=["v4", "v41"])
def test_loader_keeps_declared_formats_at_the_checkpoints_bytes(fixture, formats, request):
    from safetensors.torch import load_file

    path = request.getfixturevalue(fixture)
    raw = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        raw.update(load_file(str(f)))
    _, _, plain = _load(path, ())
    _, _, kept = _load(path, formats)
    quantised = {k: v for k, v in kept.items() if isinstance(v, QuantizedWeight)}
    assert {v.format for v in quantised.values()} == set(formats)
    assert not any(isinstance(v, QuantizedWeight) for v in plain.values())
    # every quantised stored linear weight is kept (official names: stored name = canonical name)
    stored = {k for k in raw if k.endswith(".weight") and k[: -len(".weight")] + ".scale" in raw
              and ".engram.embed." not in k}
    assert set(quantised) == stored
    for name, q in quantised.items():
        assert torch.equal(q.dequantize(torch.float32), plain[name]), name
    kept_bytes = sum(q.nbytes for q in quantised.values())
    checkpoint_bytes = sum(raw[k].nbytes + raw[k[: -len(".weight")] + ".scale"].nbytes for k in quantised)
    assert kept_bytes == checkpoint_bytes
    assert kept_bytes < 0.3 * sum(plain[k].nbytes for k in quantised)  # fp32: 4 bytes a value
    # the rest is what the dequantising load gives
    assert all(torch.equal(kept[k], plain[k]) for k in plain if k not in quantised)
    # never quantised: the embedding, norms, router (read other than through linear / experts)
    assert not any(isinstance(kept[k], QuantizedWeight) for k in kept
                   if k.endswith(("embed.weight", "norm.weight", "gate.weight")))


def test_only_the_declared_formats_stay_quantised(v4_path):
    _, _, kept = _load(v4_path, (FP4_E2M1,))
    assert {v.format for v in kept.values() if isinstance(v, QuantizedWeight)} == {FP4_E2M1}
    assert isinstance(kept["layers.0.attn.wq_a.weight"], torch.Tensor)  # FP8: dequantised


def _generate(path, formats, accelerator, dtype=torch.float32):
    family, config, weights = _load(path, formats, dtype)
    model = family.build_model(config, accelerator, dtype, torch.device("cpu"), **family.model_options())
    model.load_weights(weights)
    return model, Runner(model).generate("a", [5, 17, 42, 99, 7, 300, 11, 250, 3, 77, 8, 61], 6, [5, 7])


@pytest.mark.parametrize("fixture, formats", FAMILIES, ids=["v4", "v41"])
def test_models_give_the_same_logits_and_tokens_with_weights_kept_quantised(fixture, formats, request):
    from deepinfer_plugins.cpu.accelerator import CpuAccelerator

    path = request.getfixturevalue(fixture)
    accel = CpuAccelerator()
    _, (tokens, logits) = _generate(path, (), accel)
    model, (q_tokens, q_logits) = _generate(path, formats, accel)
    kept = {k: v.format for blk in model.blocks for k, v in blk.w.items() if isinstance(v, QuantizedWeight)}
    assert {"ffn.experts.w13", "ffn.experts.w2", "attn.fused_qr.weight"} <= set(kept)
    assert set(kept.values()) == set(formats)
    assert q_tokens == tokens
    assert max_rel_diff(q_logits, logits) < 1e-5


def _recording_accelerator(formats: tuple[str, ...]):
    """The cpu back end declaring `formats`, recording the format of every weight that reaches
    linear, grouped_linear and moe_experts (None for a plain tensor)."""
    from deepinfer_plugins.cpu.accelerator import CpuAccelerator

    class Recording(CpuAccelerator):
        def __init__(self) -> None:
            super().__init__()
            self.weight_formats, self.seen = formats, set()

        def _note(self, *weights) -> None:
            self.seen.update(w.format if isinstance(w, QuantizedWeight) else None for w in weights)

        def linear(self, x, weight):
            self._note(weight)
            return super().linear(x, weight)

        def grouped_linear(self, x, weight):
            self._note(weight)
            return super().grouped_linear(x, weight)

        def moe_experts(self, rows, plan, w13, w2, swiglu_limit):
            self._note(w13, w2)
            return super().moe_experts(rows, plan, w13, w2, swiglu_limit)

    return Recording()


@pytest.mark.parametrize("declared", [(), (FP4_E2M1,), V41_FORMATS])
def test_a_back_end_receives_only_the_formats_it_declares(v41_path, declared):
    from deepinfer.engine.builder import load_family_checkpoint
    from deepinfer.models.registry import checkpoint_family

    family, config_dict = checkpoint_family(v41_path)
    accel = _recording_accelerator(declared)
    config, weights = load_family_checkpoint(family, v41_path, torch.float32, config_dict,
                                             accel.capabilities().weight_formats)
    model = family.build_model(config, accel, torch.float32, torch.device("cpu"), **family.model_options())
    model.load_weights(weights)
    Runner(model).generate("a", [5, 17, 42, 99, 7], 2)
    assert accel.seen - {None} == set(declared)


def test_builder_passes_formats_only_to_a_loader_that_takes_them():
    from deepinfer.engine.builder import load_family_checkpoint

    calls = []

    class Old:
        @staticmethod
        def load_checkpoint(path, dtype, config_dict):
            calls.append("old")
            return None, {}

    class New:
        @staticmethod
        def load_checkpoint(path, dtype, config_dict, weight_formats=()):
            calls.append(weight_formats)
            return None, {}

    load_family_checkpoint(Old, "p", None, {}, V4_FORMATS)
    load_family_checkpoint(New, "p", None, {}, V4_FORMATS)
    load_family_checkpoint(New, "p", None, {}, ())
    assert calls == ["old", V4_FORMATS, ()]


def test_engine_with_cpu_quantized_weights_generates_the_same_tokens(v4_path, clean_env):
    from deepinfer import LLM
    from deepinfer.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [[5, 17, 42, 99], [300, 11, 250, 3, 77, 8]]
    results = {}
    for flag in ("0", "1"):
        clean_env.setenv("DEEPINFER_CPU_QUANTIZED_WEIGHTS", flag)
        llm = LLM(model=str(v4_path), accelerator="cpu", dtype="float32", max_model_len=64)
        assert llm.engine.model.accel.capabilities().weight_formats == (() if flag == "0" else
                                                                        (FP8_BLOCK128, FP8_BLOCK32, FP4_E2M1))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        results[flag] = ([o.outputs[0].token_ids for o in outs], llm.build_info.weight_bytes)
        llm.shutdown()
    assert results["1"][0] == results["0"][0]
    assert results["1"][1] < results["0"][1]  # the experts and FP8 projections at their stored size


@pytest.mark.slow
def test_batch_invariant_mode_holds_on_quantised_weights(v41_path, clean_env):
    """Each dequantised tile goes through the back end's own linear, so its batch-invariant mode
    applies: a request's greedy tokens and log-probabilities are the same bits alone and batched."""
    import random

    from deepinfer import LLM
    from deepinfer.sampling_params import SamplingParams
    from deepinfer_plugins.cpu.accelerator import CpuAccelerator

    if CpuAccelerator().native_library is None:
        pytest.skip("the cpu back end's batch-invariant mode needs its C kernels")
    clean_env.setenv("DEEPINFER_CPU_QUANTIZED_WEIGHTS", "1")
    prompts = [{"prompt_token_ids": [random.Random(i).randrange(3, 512) for _ in range(3 + 5 * i)]} for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=512)

    def traces(outs) -> list:
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
                for o in outs]

    def llm(max_num_seqs: int) -> LLM:
        return LLM(model=str(v41_path), accelerator="cpu", dtype="bfloat16", max_model_len=96,
                   max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                   features={"batch_invariant": {"enabled": True}})

    one, many = llm(1), llm(12)
    try:
        assert many.engine.model.accel.capabilities().weight_formats
        batched = traces(many.generate(prompts, params, use_tqdm=False))
        alone = [traces(one.generate([p], params, use_tqdm=False))[0] for p in prompts]
    finally:
        one.shutdown()
        many.shutdown()
    assert batched == alone


def test_the_fused_quantised_attention_decodes_the_composed_bits(v4_path, clean_env, monkeypatch):
    """bf16 decode with the FP8 attention weights kept quantised: the cpu back end's two attention calls
    (attention_layer.c on the codes) give the same tokens and log-probabilities as the composed kernels."""
    from deepinfer import LLM
    from deepinfer.models.deepseek_v4.ops import DeepseekV4Ops
    from deepinfer.sampling_params import SamplingParams
    from deepinfer_plugins.cpu import native
    from deepinfer_plugins.cpu.ops_v4 import CpuDeepseekV4Ops

    if native.library() is None:
        pytest.skip("the cpu back end's C kernels are not available here")
    clean_env.setenv("DEEPINFER_CPU_QUANTIZED_WEIGHTS", "1")
    clean_env.setenv("DEEPINFER_CPU_DECODE_BLOCKS", "0")  # decode programs call by call: through these ops
    calls = []
    for name in ("attention_projections_arguments", "attention_output"):
        def counted(*args, _fn=getattr(native, name), _name=name, **kw):
            out = _fn(*args, **kw)
            calls.append(_name if out is not None else None)
            return out
        monkeypatch.setattr(native, name, counted)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=20)
    prompts = [{"prompt_token_ids": [5, 17, 42, 99, 7]}, {"prompt_token_ids": [300, 11, 250]}]

    def generate() -> list:
        llm = LLM(model=str(v4_path), accelerator="cpu", dtype="bfloat16", max_model_len=64, max_num_seqs=1)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
                for o in outs]

    fused = generate()
    assert {"attention_projections_arguments", "attention_output"} <= set(calls)
    monkeypatch.setattr(CpuDeepseekV4Ops, "attention_projections", DeepseekV4Ops.attention_projections)
    monkeypatch.setattr(CpuDeepseekV4Ops, "decode_attention_output", DeepseekV4Ops.decode_attention_output)
    assert generate() == fused
