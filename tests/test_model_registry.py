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
    assert family.model_class is DeepseekV4ForCausalLM and family.op_defaults.model_options == {"query_block": 256, "cp_min_tokens": 16}
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


# --- third-party families: the deepinfer.model_families entry-point group ----------------------

EP_BASE = '''
import torch
from deepinfer.models.registry import ModelFamily


class Model:
    def __init__(self, config, accelerator, dtype=torch.float32, device="cpu"):
        self.config, self.device = config, torch.device(device)

    def load_weights(self, weights): ...
    def cache_layout(self, max_rollback): ...
    def bind_cache(self, cache): ...
    def forward(self, batch): ...
    def drafter_heads(self): return None


def family(model_type):
    return ModelFamily(model_type=model_type, parse_config=lambda d, source: None,
                       load_checkpoint=lambda path, dtype, d: (None, {}), model_class=Model)
'''
EP_MODULES = {
    "ep_base": EP_BASE,
    "ep_object": "from ep_base import family\nFAMILY = family('ep_object')\n",
    "ep_module": "from deepinfer.models.registry import register_model_family\nfrom ep_base import family\n"
                 "register_model_family(family('ep_module'))\n",
    "ep_callable": "from ep_base import family\ndef make():\n    return family('ep_callable')\n",
    "ep_broken": "import no_such_dependency_of_ep_broken\n",
    "ep_misnamed": "from ep_base import family\nFAMILY = family('something_else')\n",
}
EP_NAMES = {"ep_object": "ep_object:FAMILY", "ep_module": "ep_module", "ep_callable": "ep_callable:make",
            "ep_broken": "ep_broken", "ep_misnamed": "ep_misnamed:FAMILY"}


@pytest.fixture
def family_plugins(fake_distribution):
    fake_distribution("acme-models", "1.2", {registry.MODEL_FAMILY_GROUP: EP_NAMES}, EP_MODULES)
    yield
    for name in [*EP_NAMES, "something_else"]:
        unregister_model_family(name)


def test_entry_point_families_are_listed_without_import_and_loaded_on_first_look_up(family_plugins):
    import sys

    assert set(EP_NAMES) <= set(supported_model_types()) and "deepseek_v4" in supported_model_types()
    assert not {"ep_object", "ep_module", "ep_callable"} & set(sys.modules)  # listing imports nothing
    for name in ("ep_object", "ep_module", "ep_callable"):  # an object, a module, a callable
        family = get_model_family(name)
        assert family.model_type == name and get_model_family(name) is family
    assert "ep_broken" not in sys.modules


def test_a_broken_entry_point_names_itself_and_leaves_the_other_families_alone(family_plugins):
    from deepinfer.models.common.errors import ModelFamilyPluginError

    with pytest.raises(ModelFamilyPluginError) as e:
        get_model_family("ep_broken")
    message = str(e.value)
    assert "entry point 'ep_broken = ep_broken'" in message and "distribution acme-models 1.2" in message
    assert "ModuleNotFoundError" in message and "no_such_dependency_of_ep_broken" in message
    with pytest.raises(ModelFamilyPluginError, match=r"'ep_misnamed = ep_misnamed:FAMILY'.*registered no family "
                                                     r"'ep_misnamed'.*named after the model_type"):
        get_model_family("ep_misnamed")
    assert get_model_family("deepseek_v4").model_type == "deepseek_v4"
    assert registry.find_model_family("v4").model_type == "deepseek_v4"
    assert "ep_object" in {f.model_type for f in registry.all_model_families()}  # listing skips the broken one


def test_entry_points_never_shadow_an_in_tree_family(fake_distribution):
    fake_distribution("shadow", "0.1", {registry.MODEL_FAMILY_GROUP: {"deepseek_v4": "ep_broken"}},
                      {"ep_broken": EP_MODULES["ep_broken"]})
    assert get_model_family("deepseek_v4").model_class.__name__ == "DeepseekV4ForCausalLM"


def test_load_model_family_takes_entry_point_syntax(fake_distribution):
    fake_distribution("direct", "0.1", {}, {"ep_base": EP_BASE, "ep_object": EP_MODULES["ep_object"]})
    try:
        registry.load_model_family("ep_object:FAMILY")
        assert get_model_family("ep_object").model_type == "ep_object"
        with pytest.raises(TypeError, match="expected a module, a ModelFamily or a callable"):
            registry.load_model_family("torch:float32")
    finally:
        unregister_model_family("ep_object")


# --- aliases, checkpoint makers, model options -------------------------------------------------

def test_aliases_are_found_and_must_not_collide(clean):
    family = register_model_family(_family(aliases=("utf",)))
    assert registry.find_model_family("utf") is family and registry.find_model_family("unit_test_family") is family
    assert family.label == "unit_test_family (alias utf)"
    assert registry.find_model_family("v4").model_type == "deepseek_v4"
    with pytest.raises(UnknownModelTypeError, match=r"unknown model family 'nope'; choose a model_type or alias: "
                                                    r".*deepseek_v4 \(alias v4\).*unit_test_family \(alias utf\)"):
        registry.find_model_family("nope")
    with pytest.raises(ValueError, match=r"aliases \['utf'\] already name model family 'unit_test_family'"):
        register_model_family(_family("other_test_family", aliases=("utf",)))
    with pytest.raises(ValueError, match="aliases must be non-empty names other than the model_type"):
        _family(aliases=("unit_test_family",))


def test_checkpoint_maker_is_validated():
    with pytest.raises(ValueError, match="sizes must be non-empty preset names"):
        registry.CheckpointMaker(make=lambda *a, **k: "", sizes=())
    with pytest.raises(ValueError, match="make_checkpoint must be a CheckpointMaker"):
        _family(make_checkpoint=lambda *a: "")
    v4 = get_model_family("deepseek_v4")
    assert v4.aliases == ("v4",) and v4.make_checkpoint.sizes == ("tiny", "default", "bench")


def test_model_options_accept_declared_keys_only():
    family = _family(op_defaults=OpDefaults(model_options={"block": 8, "mode": "a"}))
    assert family.model_options({"block": 2}) == {"block": 2, "mode": "a"}
    with pytest.raises(ValueError, match=r"model_options \['blok'\] are not options of model family "
                                         r"'unit_test_family'; its options \(OpDefaults.model_options\) "
                                         r"are: block, mode"):
        family.model_options({"blok": 2})
    with pytest.raises(ValueError, match=r"\['blok'\]"):
        family.build_model(_Config(), object(), torch.float32, "cpu", blok=2)


@pytest.mark.parametrize("model_type", ["deepseek_v4", "deepseek_v41"])
@pytest.mark.parametrize("options, words", [
    ({"query_block": 0}, ["model_options.query_block = 0 is out of range", "integer in [1, 8192]"]),
    ({"query_block": -64}, ["model_options.query_block = -64"]),
    ({"query_block": 10**9}, ["model_options.query_block = 1000000000", "[1, 8192]"]),
    ({"query_block": "256"}, ["model_options.query_block = '256' has the wrong type (a string)"]),
    ({"query_block": True}, ["model_options.query_block = True has the wrong type (a bool)"]),
    ({"cp_min_tokens": 0}, ["model_options.cp_min_tokens = 0 is out of range"]),
])
def test_model_options_that_set_work_are_bounded(model_type, options, words):
    family = get_model_family(model_type)
    with pytest.raises(ValueError) as e:
        family.model_options(options)
    assert f"invalid model_options of model family '{model_type}'" in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert family.model_options({"query_block": 1, "cp_min_tokens": 1}) == {"query_block": 1, "cp_min_tokens": 1}


def test_option_ranges_must_describe_declared_options():
    from deepinfer.models.common.config_values import Range

    with pytest.raises(ValueError, match=r"option_ranges \['blok'\] must be Ranges of declared model_options"):
        OpDefaults(model_options={"block": 8}, option_ranges={"blok": Range(int, 1)})
    family = _family(op_defaults=OpDefaults(model_options={"block": 8}, option_ranges={"block": Range(int, 1, 64)}))
    with pytest.raises(ValueError, match=r"model_options.block = 65 is out of range: must be an integer in \[1, 64\]"):
        family.model_options({"block": 65})


def test_engine_config_overrides_the_familys_model_options(tiny_v4, tmp_path):
    from deepinfer import LLM
    from deepinfer.config import load_config

    path = tiny_v4
    llm = LLM(model=str(path), accelerator="cpu", max_model_len=64, max_num_seqs=2, model_options={"query_block": 8})
    try:
        assert llm.engine.model.query_block == 8 and llm.config.model_options == {"query_block": 8}
    finally:
        llm.shutdown()
    toml = tmp_path / "engine.toml"
    toml.write_text("[model_options]\nquery_blok = 8\n")
    assert load_config(config_file=toml).model_options == {"query_blok": 8}
    with pytest.raises(ValueError, match=r"model_options \['query_blok'\] are not options of model family "
                                         r"'deepseek_v4'; its options .* are: cp_min_tokens, query_block"):
        LLM(model=str(path), accelerator="cpu", config=str(toml))
    with pytest.raises(ValueError, match=r"model_options.query_block = 0 is out of range"):  # before any weight is read
        LLM(model=str(path), accelerator="cpu", model_options={"query_block": 0})
