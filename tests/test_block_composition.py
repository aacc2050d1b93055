"""DeepSeek-V4 blocks are ordered lists of sub-modules: a module can be inserted (e.g. a V4.1
Engram-like memory before attention) without editing the block class; V4 builds [attn, ffn]."""
from __future__ import annotations

import pytest
import torch

from model_harness import Runner, accelerator
from deepinfer.models.deepseek_v4.block import ATTN, FFN, DecoderBlock, HyperConnected, build_decoder_block
from deepinfer.models.deepseek_v4.make_model import model_config, random_weights
from deepinfer.models.deepseek_v4 import model as model_module
from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM


class Recorder:
    """A stream module that records what it sees and optionally changes the streams."""

    def __init__(self, name, log, scale=1.0):
        self.name, self.log, self.scale = name, log, scale

    def forward(self, streams, step):
        self.log.append((self.name, streams.clone(), step.input_ids.clone()))
        return streams if self.scale == 1.0 else streams * self.scale


@pytest.fixture(scope="module")
def model():
    config, _ = model_config("tiny", num_hidden_layers=3)
    m = DeepseekV4ForCausalLM(config, accelerator(), torch.float32, "cpu")
    m.load_weights(random_weights(config, seed=2, with_mtp=False))
    return m


def _logits(model, tokens):
    r = Runner(model)
    r.add("s")
    return r.step({"s": tokens})["s"]


def test_v4_blocks_are_attention_then_moe(model):
    for blk in model.blocks:
        assert blk.names == [ATTN, FFN]
        assert all(isinstance(m, HyperConnected) for m in blk.modules)
        assert blk.attn is blk.module(ATTN).layer and blk.ffn is blk.module(FFN).layer


def test_an_inserted_module_runs_before_attention_and_its_output_is_used(model):
    tokens = [3, 9, 27, 81, 243, 7, 8, 9, 10, 11]
    plain = _logits(model, tokens)
    blk = model.blocks[1]
    log = []
    blk.insert_before(ATTN, Recorder("engram", log))
    blk.insert_before(FFN, Recorder("between", log))
    try:
        assert blk.names == ["engram", ATTN, "between", FFN]
        same = _logits(model, tokens)
        assert torch.equal(same, plain)  # identity modules: the composition itself changes nothing
        assert [name for name, _, _ in log] == ["engram", "between"]
        (_, before_attn, ids), (_, after_attn, _) = log
        assert before_attn.shape == (len(tokens), model.config.hc_mult, model.config.hidden_size)
        assert torch.equal(ids, torch.tensor(tokens))
        assert not torch.equal(before_attn, after_attn)  # attention ran in between
        blk.modules[0].scale = 0.5  # now the pre-module changes the streams attention sees
        assert not torch.allclose(_logits(model, tokens), plain)
    finally:
        blk.modules = [m for m in blk.modules if not isinstance(m, Recorder)]
    assert torch.equal(_logits(model, tokens), plain)


def test_build_with_pre_modules_and_bad_names(model):
    c = model.config
    blk = model.blocks[0]
    built = build_decoder_block(c, c.layer_types[0], c.mlp_layer_types[0], blk.w, model.accel,
                                pre_modules=[Recorder("engram", [])])
    assert built.names == ["engram", ATTN, FFN]
    with pytest.raises(KeyError, match=r"no sub-module 'mla'; it has \['engram', 'attn', 'ffn'\]"):
        built.insert_before("mla", Recorder("x", []))
    with pytest.raises(ValueError, match="must be unique"):
        DecoderBlock([Recorder("a", []), Recorder("a", [])], {})


def _unfused(blocks, streams, step):
    """Every module's own forward: hc_pre_norm and hc_post around each sub-layer, no op between two."""
    for blk in blocks:
        for m in blk.modules:
            streams = m.forward(streams, step)
    return streams


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_op_between_sub_layers_keeps_the_bits(dtype, monkeypatch):
    """The model loop's hc_post_pre_norm between two mHC sites (within a block and across blocks) gives
    the bits of the two ops, at prefill, at decode and at a decode batch of 4 (decode steps: their program,
    which the cpu back end prepares, against every module's own forward)."""
    config, _ = model_config("tiny", num_hidden_layers=3)
    m = DeepseekV4ForCausalLM(config, accelerator(), dtype, "cpu")
    m.load_weights(random_weights(config, seed=3, with_mtp=False))
    steps = [{"a": [5, 6, 7, 8, 9, 10], "b": [1, 2, 3], "c": [4], "d": [11, 12]}] + \
            [{k: [20 + i] for k in "abcd"} for i in range(3)] + [{"a": [40]}]

    def run():
        r = Runner(m)
        for key in "abcd":
            r.add(key)
        return [r.step(chunks) for chunks in steps]

    run()  # the back end's weight copies made at a weight's second use (e.g. mHC's transposed fn) exist from now
    fused = run()
    monkeypatch.setattr(model_module, "run_blocks", _unfused)
    monkeypatch.setattr(model_module, "DECODE_PROGRAM_MAX_TOKENS", 0)  # every step through run_blocks
    for got, want in zip(fused, run()):
        assert all(torch.equal(got[k], want[k]) for k in want)
