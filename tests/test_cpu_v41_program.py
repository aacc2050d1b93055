"""DeepSeek-V4.1's decode step as a program (sites.lower_blocks, Attention.lower_decode) prepared by the cpu
back end: its C calls bound once give the bits of the same program run call by call and of the modules run
one by one (Engram layers, every attention role, windows completing, the indexer's and the candidate pool's
picks), for one sequence and for decode batches; fp32 binds only the site calls; weights kept quantised
decode the same tokens."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer.models.deepseek_v41 import model as v41_model
from deepinfer.models.deepseek_v41.checkpoint import load_checkpoint
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_plugins.cpu import native
from model_harness import Runner, accelerator
from test_cpu_prepared_program import bound_ops, greedy_quantised

#: the V4.1 decode program's calls the cpu back end binds (bf16, once the packed copies exist)
BOUND_OPS = {"ops.hc_mix_collapse_norm", "ops.hc_post_mix_collapse_norm", "ops.attention_projections",
             "ops.decode_attention_output", "kernels.moe_sublayer"}


@pytest.fixture(scope="module")
def loaded(tiny_v41):
    return {dtype: load_checkpoint(tiny_v41, dtype) for dtype in (torch.bfloat16, torch.float32)}


class Modules:
    """A model whose decode steps run module by module (no program): `run_blocks`, as prefill does."""

    def __init__(self, model: DeepseekV41ForCausalLM, monkeypatch):
        self.model, self.monkeypatch = model, monkeypatch

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, batch):
        with self.monkeypatch.context() as m:
            m.setattr(v41_model, "DECODE_PROGRAM_MAX_TOKENS", 0)
            return self.model.forward(batch)


def _models(loaded, monkeypatch, dtype=torch.bfloat16):
    """(prepared, call by call, module by module) models over the same weights."""
    config, weights = loaded[dtype]
    models = []
    for _ in range(3):
        model = DeepseekV41ForCausalLM(config, accelerator(), dtype=dtype)
        model.load_weights(weights)
        models.append(model)
    if models[0].accel.native_library is None:
        pytest.fail("the native library did not build; see the warning logged by deepinfer_plugins.cpu.native")
    models[1].accel.prepared_programs = False  # the same program, call by call
    return models[0], models[1], Modules(models[2], monkeypatch)


def _decode(models, prompts: dict, steps: int) -> None:
    """Prefill `prompts` on every model, then decode greedily (the first model's tokens) `steps` times;
    every step's logits are the same bits on every model."""
    runners = [Runner(m, num_slots=max(8, len(prompts))) for m in models]
    for r in runners:
        for key in prompts:
            r.add(key)
    outs = [r.step(prompts) for r in runners]
    for step in range(steps):
        tokens = {k: [int(outs[0][k][-1].argmax())] for k in prompts}
        outs = [r.step(tokens) for r in runners]
        for k in prompts:
            for name, out in zip(("call by call", "module by module"), outs[1:]):
                assert torch.equal(outs[0][k], out[k]), f"decode step {step}, sequence {k}: {name}"


def test_decode_steps_give_the_bits_of_the_modules(loaded, monkeypatch, prepared_runs):
    """One sequence decodes 40 steps past its prompt (windows of every ratio complete, the indexer and the
    candidate pool pick): the prepared program, the program call by call and the modules give the same
    logits, and every site, attention and MoE is one C call."""
    models = _models(loaded, monkeypatch)
    config = models[0].config
    _decode(models, {"a": [random.Random(0).randrange(3, config.vocab_size) for _ in range(19)]}, 40)
    assert len(prepared_runs) == 40 and len(set(map(id, prepared_runs))) == 1  # one program, for one token
    if models[0].accel.native_amx:  # the composed ops run AMX tiles, which the calls do not take
        return
    layers, engram = config.num_hidden_layers, len(config.engram_layer_ids)
    alone = engram + (0 not in config.engram_layer_ids)  # the first site, and each after an Engram module
    assert bound_ops(prepared_runs[-1]) == {
        "ops.hc_mix_collapse_norm": alone, "ops.hc_post_mix_collapse_norm": 2 * layers - alone,
        "ops.attention_projections": layers, "ops.decode_attention_output": layers, "kernels.moe_sublayer": layers}


def test_decode_batches_give_the_bits_of_the_modules(loaded, monkeypatch, prepared_runs):
    """Six sequences at ragged contexts decode together: the program prepared for 6 tokens gives the
    logits of the program call by call and of the modules."""
    models = _models(loaded, monkeypatch)
    rng = random.Random(1)
    prompts = {i: [rng.randrange(3, models[0].config.vocab_size) for _ in range(4 + 9 * i)] for i in range(6)}
    _decode(models, prompts, 12)
    assert {p.program.key for p in prepared_runs} == {("decode", 6)}
    bound = set(bound_ops(prepared_runs[-1]))
    # the portable tier (no register tiles, a one-row GEMV) runs a batch's MoE in torch, and where AMX tiles
    # take the multi-row products the C MoE sub-layer takes one row only: not bound there
    accel = models[0].accel
    multi_row_products = accel.tuning.packed_gemm_rows != (0, 0) and not accel.native_amx
    assert {"ops.hc_mix_collapse_norm", "ops.hc_post_mix_collapse_norm"} <= bound
    assert ("kernels.moe_sublayer" in bound) == multi_row_products


def test_a_float32_model_binds_only_the_site_calls(loaded, monkeypatch, prepared_runs):
    """fp32 (the reference dtype): the site entries are C calls either way and are bound; attention and MoE,
    which the composed ops run in torch for fp32, run as those ops. The same bits as call by call."""
    models = _models(loaded, monkeypatch, torch.float32)
    _decode(models, {"a": [5, 9, 200, 31, 7]}, 6)
    assert set(bound_ops(prepared_runs[-1])) == {"ops.hc_mix_collapse_norm", "ops.hc_post_mix_collapse_norm"}


def test_a_prefill_runs_no_program(loaded, monkeypatch, prepared_runs):
    """A prefill step runs module by module; the decode step after it runs the program."""
    prepared, _, _ = _models(loaded, monkeypatch)
    runner = Runner(prepared, num_slots=2)
    runner.add("a")
    out = runner.step({"a": [5, 9, 200, 31, 7]})
    assert not prepared_runs
    runner.step({"a": [int(out["a"][-1].argmax())]})
    assert len(prepared_runs) == 1


def test_weights_kept_quantised_decode_the_same_tokens(tiny_v41, clean_env, prepared_runs):
    """FP4 experts and FP8 attention weights kept quantised (`DEEPINFER_CPU_QUANTIZED_WEIGHTS=1`): the
    program binds the `*_quant` calls and gives the tokens and log-probabilities of the modules."""
    assert greedy_quantised(tiny_v41, clean_env, prepared=True) == greedy_quantised(tiny_v41, clean_env,
                                                                                   prepared=False)
    bound = bound_ops(prepared_runs[-1])
    if not native.amx_usable(native.active_library()):
        assert {"ops.attention_projections", "kernels.moe_sublayer"} <= bound.keys()
