"""Engine configuration: sources, precedence, and errors that name the valid choices."""
from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from deepinfer import envs
from deepinfer.config import EngineConfig, load_config, resolve_feature_configs


def test_defaults(clean_env):
    cfg = load_config()
    assert cfg == EngineConfig()
    assert cfg.gpu_memory_utilization == 0.85 and cfg.async_pipeline is None  # auto: per back end


def test_precedence_arguments_over_env_over_file(clean_env, tmp_path):
    toml = tmp_path / "engine.toml"
    toml.write_text('accelerator = "from-file"\nmax_num_seqs = 3\nseed = 7\n[features.dspark]\nnum_draft_tokens = 2\n')
    clean_env.setenv("DEEPINFER_CONFIG", str(toml))
    assert load_config().accelerator == "from-file"
    clean_env.setenv("DEEPINFER_ACCELERATOR", "from-env")
    cfg = load_config()
    assert cfg.accelerator == "from-env" and cfg.max_num_seqs == 3 and cfg.seed == 7
    assert cfg.features == {"dspark": {"num_draft_tokens": 2}}
    cfg = load_config({"accelerator": "from-args", "seed": None})
    assert cfg.accelerator == "from-args" and cfg.seed == 7  # None arguments do not override


def test_explicit_config_file_argument(clean_env, tmp_path):
    toml = tmp_path / "x.toml"
    toml.write_text("max_num_batched_tokens = 128\n")
    assert load_config(config_file=toml).max_num_batched_tokens == 128


def test_unknown_key_names_valid_keys(clean_env, tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("max_num_seq = 3\n")
    with pytest.raises(ValueError) as e:
        load_config(config_file=toml)
    assert "max_num_seq" in str(e.value) and "max_num_seqs" in str(e.value) and "file" in str(e.value)


def test_bad_values_name_choices(clean_env):
    with pytest.raises(ValueError, match="'float32' or 'bfloat16'"):
        load_config({"dtype": "float16"})
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        load_config({"gpu_memory_utilization": 1.5})
    with pytest.raises(ValueError, match="divisible by ep"):
        load_config({"ep": 2, "dp": 1, "cp": 1})


def test_missing_and_invalid_toml(clean_env, tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(config_file=tmp_path / "nope.toml")
    bad = tmp_path / "broken.toml"
    bad.write_text("this is = = not toml")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(config_file=bad)


class DemoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_draft_tokens: int = 5
    variable_length: bool = False


def test_feature_tables_validated_against_their_model(clean_env):
    cfg = load_config({"features": {"dspark": {"num_draft_tokens": 3}}})
    out = resolve_feature_configs(cfg, {"dspark": DemoConfig})
    assert out["dspark"].num_draft_tokens == 3
    cfg = load_config({"features": {"dspark": {"num_drafts": 3}, "nope": {}}})
    with pytest.raises(ValueError) as e:
        resolve_feature_configs(cfg, {"dspark": DemoConfig})
    msg = str(e.value)  # every problem at once
    assert "features.dspark.num_drafts" in msg and "num_draft_tokens" in msg and "features.nope" in msg


def test_feature_env_vars_map_to_fields(clean_env):
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    clean_env.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    out = resolve_feature_configs(load_config(), {"dspark": DemoConfig})
    assert out["dspark"].num_draft_tokens == 0 and out["dspark"].variable_length is True


def test_env_var_of_missing_feature_is_rejected(clean_env):
    clean_env.setenv("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "32")
    with pytest.raises(ValueError) as e:
        resolve_feature_configs(load_config(), {})
    assert "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS" in str(e.value) and "eplb" in str(e.value)


def test_bad_env_value(clean_env):
    clean_env.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "maybe")
    with pytest.raises(ValueError, match="not a boolean"):
        resolve_feature_configs(load_config(), {"dspark": DemoConfig})


def test_every_variable_is_documented():
    for var in envs.VARIABLES.values():
        assert var.name.startswith("DEEPINFER_") and len(var.doc) > 20
    with pytest.raises(KeyError, match="not a documented"):
        envs.get("DEEPINFER_NOT_A_THING")
