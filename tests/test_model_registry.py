"""The model registry and the Model protocol: families keyed by config.json's model_type."""
from __future__ import annotations

import json

import pytest
import torch

from deepinfer.models import registry
from deepinfer.models.common.errors import CheckpointError, UnknownModelTypeError
from deepinfer.models.interface import Model, drafter_heads
from deepinfer.models.registry import (
    ModelFamily, OpDefaults, get_model_family, register_model_family, supported_model_types, unregister_model_family,
)


class _Complete:
    def __init__(self, config, accelerator, dtype=torch.float32, device="cpu", **options):
        self.config, self.device, self.options = config, torch.device(device), options

    def load_weights(self, weights): ...
    def cache_layout(self, max_rollback): ...
    def bind_cache(self, cache): ...
    def forward(self, batch): ...
    def drafter_heads(self): return None


class _Config:
    vocab_size, max_position_embeddings, bos_token_id, eos_token_id = 10, 32, 0, 1


def _family(model_type="unit_test_family", model_class=_Complete, **kw) -> ModelFamily:
    return ModelFamily(model_type=model_type, parse_config=lambda d, source: _Config(),
                       load_checkpoint=lambda path, dtype, d: (_Config(), {}), model_class=model_class, **kw)


@pytest.fixture
def clean():
    yield
    unregister_model_family("unit_test_family")


def test_deepseek_v4_is_built_in_and_resolved_lazily():
    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

    assert "deepseek_v4" in supported_model_types()
    family = get_model_family("deepseek_v4")
    assert family.model_class is DeepseekV4ForCausalLM and family.op_defaults.model_options == {"query_block": 256}
    assert {"sink_attention", "moe_experts", "hc_pre"} <= set(family.op_defaults.required_ops)


@pytest.mark.parametrize("model_type", ["llama", None, 3, "DeepSeek_V4"])
def test_unknown_model_types_list_the_supported_ones(model_type):
    with pytest.raises(UnknownModelTypeError) as e:
        get_model_family(model_type, "/ckpt/config.json")
    message = str(e.value)
    assert isinstance(e.value, CheckpointError)
    assert f"/ckpt/config.json: model_type {model_type!r} is not supported" in message
    assert "supported model types: " + ", ".join(supported_model_types()) in message


def test_checkpoint_family_reads_config_json_once(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    reads = []
    real = registry.read_config
    monkeypatch.setattr(registry, "read_config", lambda p: reads.append(p) or real(p))
    with pytest.raises(UnknownModelTypeError, match="'llama' is not supported; supported model types: deepseek_v4"):
        registry.checkpoint_family(tmp_path)
    assert reads == [tmp_path]
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        registry.checkpoint_family(tmp_path / "absent")


def test_register_replace_and_unregister(clean):
    first = register_model_family(_family())
    assert get_model_family("unit_test_family") is first
    assert register_model_family(first) is first  # the same entry again: a no-op
    with pytest.raises(ValueError, match=r"'unit_test_family' is already registered .*replace=True"):
        register_model_family(_family())
    second = register_model_family(_family(), replace=True)
    assert get_model_family("unit_test_family") is second and "unit_test_family" in supported_model_types()
    assert unregister_model_family("unit_test_family") is second
    assert "unit_test_family" not in supported_model_types()


def test_a_model_class_must_implement_the_protocol():
    class NoCache(_Complete):
        bind_cache = None
        drafter_heads = None

    with pytest.raises(ValueError, match=r"lacks the Model methods \['bind_cache', 'drafter_heads'\]"):
        _family(model_class=NoCache)
    with pytest.raises(ValueError, match="model_type must be a non-empty string"):
        _family(model_type="")
    with pytest.raises(ValueError, match="required_ops must be accelerator method names"):
        OpDefaults(required_ops=("linear", "not a name"))


def test_build_model_passes_the_op_defaults_and_checks_the_kernels():
    family = _family(op_defaults=OpDefaults(required_ops=("linear",), model_options={"block": 8}))
    model = family.build_model(_Config(), object(), torch.float32, "cpu")
    assert model.options == {"block": 8} and isinstance(model, Model)
    assert family.build_model(_Config(), object(), torch.float32, "cpu", block=2).options == {"block": 2}
    with pytest.raises(ValueError, match=r"needs the accelerator kernels \['linear'\]"):
        family.check_accelerator(object())
    family.check_accelerator(type("Acc", (), {"linear": lambda self, x, w: x})())


def test_activation_estimate_is_the_familys():
    from deepinfer.models.deepseek_v4.make_model import model_config

    config, _ = model_config("tiny")
    v4 = get_model_family("deepseek_v4")
    # V4's residual stream is hc_mult copies of the hidden state
    assert v4.activation_reserve_bytes(config, 64, 4) == 64 * 64 * 4 * 4 * 16 + 4 * 512 * 4 * 4
    generic = _family()
    assert generic.activation_reserve_bytes(config, 64, 4) == 64 * 64 * 4 * 16 + 4 * 512 * 4 * 4


def test_v4_drafter_heads_and_has_mtp_agree():
    from model_harness import accelerator

    from deepinfer.models.deepseek_v4.make_model import model_config, random_weights
    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

    config, _ = model_config("tiny", num_hidden_layers=2)
    weights = random_weights(config, seed=1, with_mtp=True)
    model = DeepseekV4ForCausalLM(config, accelerator(), torch.float32, "cpu")
    assert isinstance(model, Model)
    model.load_weights(weights)
    assert model.drafter_heads() == (model.mtp_block,) and model.has_mtp and drafter_heads(model) is not None
    model.load_weights({k: v for k, v in weights.items() if not k.startswith("mtp.")})
    assert model.drafter_heads() is None and not model.has_mtp
    assert drafter_heads(object()) is None  # a model without the method has no heads
