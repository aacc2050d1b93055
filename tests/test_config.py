"""Engine configuration: sources, precedence, and errors that name the valid choices."""
from __future__ import annotations

import re

import pytest
from pydantic import BaseModel, ConfigDict

from deepinfer import envs
from deepinfer.config import EngineConfig, load_config, resolve_feature_configs
from deepinfer.features import FeatureSpec


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


@pytest.mark.parametrize("key, value, words", [
    ("max_model_len", 2**31, ["max_model_len", "less than or equal to 16777216"]),
    ("max_model_len", 1, ["max_model_len", "greater than or equal to 2"]),  # no room for a prompt and one token
    ("max_num_seqs", 10**7, ["max_num_seqs", "less than or equal to 65536"]),
    ("max_num_batched_tokens", 2**40, ["max_num_batched_tokens", "less than or equal to 16777216"]),
    ("block_size", 2**20, ["block_size", "less than or equal to 65536"]),
    ("sampler_force_topk", 2**40, ["sampler_force_topk", "less than or equal to 4194304"]),
    ("ep", 10**6, ["ep", "less than or equal to 4096"]),
])
def test_settings_that_size_work_have_upper_bounds(clean_env, key, value, words):
    with pytest.raises(ValueError) as e:
        load_config({key: value})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


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


LEVEL_FEATURE = """
from pydantic import BaseModel, ConfigDict
import deepinfer
from deepinfer.envs import EnvVar
from deepinfer.features import FeatureSpec


class LevelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: int = 1


class Level:
    def __init__(self, config):
        self.config = config

    @staticmethod
    @deepinfer.hookimpl
    def deepinfer_feature_spec():
        return FeatureSpec(name="level", config_model=LevelConfig, hooks=(),
                           env_vars=(EnvVar("DEEPINFER_LEVEL", "the level of the level feature", field="level",
                                            kind=int),))
"""


@pytest.fixture
def level_feature(fake_distribution):
    fake_distribution("level-feature", "1.0", {"deepinfer.features": {"level": "level_feature:Level"}},
                      {"level_feature": LEVEL_FEATURE})
    import level_feature
    return level_feature


def test_a_feature_declares_its_env_vars_on_its_spec(level_feature, clean_env):
    spec = level_feature.Level.deepinfer_feature_spec()
    assert [(v.name, v.field, v.kind) for v in spec.env_vars] == [("DEEPINFER_LEVEL", "level", int)]
    assert "DEEPINFER_LEVEL" not in envs.VARIABLES  # the core does not know it by itself
    clean_env.setenv("DEEPINFER_LEVEL", "7")
    out = resolve_feature_configs(load_config(), {"level": level_feature.LevelConfig})
    assert out["level"].level == 7
    assert envs.get("DEEPINFER_LEVEL") == "7" and "DEEPINFER_LEVEL: feature level:" in envs.describe()
    clean_env.setattr(envs, "_warned", set())
    assert envs.warn_unknown() == []  # a loaded feature's variable is a documented one


def test_a_spec_env_var_must_name_a_field_of_the_config_model(level_feature):
    with pytest.raises(ValueError, match="sets field 'levl', which LevelConfig does not have"):
        FeatureSpec(name="level", config_model=level_feature.LevelConfig, hooks=(),
                    env_vars=(envs.EnvVar("DEEPINFER_LEVEL", "the level", field="levl", kind=int),))
    with pytest.raises(ValueError, match="core's variables"):
        FeatureSpec(name="level", config_model=level_feature.LevelConfig, hooks=(),
                    env_vars=(envs.EnvVar("DEEPINFER_ACCELERATOR", "the level", field="level"),))
    with pytest.raises(ValueError, match="only when true, which needs kind bool"):
        FeatureSpec(name="level", config_model=level_feature.LevelConfig, hooks=(),
                    env_vars=(envs.EnvVar("DEEPINFER_LEVEL", "the level", field="level", kind=int,
                                          enables_feature="when_true"),))


def test_two_features_cannot_declare_the_same_variable(fake_distribution):
    from deepinfer.plugins import feature_specs

    copycat = (LEVEL_FEATURE.replace('name="level"', 'name="copycat"').replace("class Level:", "class Copycat:")
               .replace("DEEPINFER_LEVEL", "DEEPINFER_USE_NEXTN_DECODE"))  # dspark's variable
    fake_distribution("copycat", "1.0", {"deepinfer.features": {"copycat": "copycat:Copycat"}}, {"copycat": copycat})
    specs, errors = feature_specs()
    [(loser, message)] = [(n, m) for n, m in errors.items() if n in ("copycat", "dspark")]
    assert "DEEPINFER_USE_NEXTN_DECODE" in message and "already declares" in message and loser not in specs


def test_dspark_env_vars_map_to_fields(clean_env):
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    clean_env.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    out = resolve_feature_configs(load_config(), {"dspark": DemoConfig})
    assert out["dspark"].num_draft_tokens == 0 and out["dspark"].variable_length is True


def test_env_var_of_a_feature_outside_the_installed_ones_is_rejected(level_feature, clean_env):
    clean_env.setenv("DEEPINFER_LEVEL", "3")
    with pytest.raises(ValueError) as e:
        resolve_feature_configs(load_config(), {"dspark": DemoConfig})
    assert "DEEPINFER_LEVEL" in str(e.value) and "the feature 'level'" in str(e.value)


def test_env_var_of_a_feature_not_in_this_release_is_rejected(clean_env):
    # (the eplb feature took DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS over; the mechanism stays for the next one)
    clean_env.setitem(envs.NOT_IN_THIS_RELEASE, "DEEPINFER_FUTURE_KNOB", "a future feature")
    clean_env.setenv("DEEPINFER_FUTURE_KNOB", "32")
    with pytest.raises(ValueError) as e:
        resolve_feature_configs(load_config(), {})
    msg = str(e.value)
    assert "DEEPINFER_FUTURE_KNOB" in msg and "a future feature" in msg and "not available in this release" in msg
    clean_env.setattr(envs, "_warned", set())
    assert envs.warn_unknown() == []  # refused, not merely warned about


def test_bad_env_value(clean_env):
    clean_env.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "maybe")
    with pytest.raises(ValueError, match="not a boolean"):
        resolve_feature_configs(load_config(), {"dspark": DemoConfig})


def test_every_variable_is_documented():
    for var in [*envs.VARIABLES.values(), *(v for _, v in envs.feature_variables().values())]:
        assert var.name.startswith("DEEPINFER_") and len(var.doc) > 20
    with pytest.raises(KeyError, match="not a documented"):
        envs.get("DEEPINFER_NOT_A_THING")


def test_a_log_level_that_is_not_one_is_refused(clean_env, capsys):
    import logging

    from deepinfer import LLM
    from deepinfer.entrypoints.serve import main as serve

    assert envs.log_level("INFO") == logging.INFO  # unset: the default
    clean_env.setenv("DEEPINFER_LOG_LEVEL", "debug")
    assert envs.log_level() == logging.DEBUG
    envs.check_values()
    clean_env.setenv("DEEPINFER_LOG_LEVEL", "garbage")
    message = "DEEPINFER_LOG_LEVEL='garbage' is not valid; use one of DEBUG, INFO, WARNING, ERROR, CRITICAL"
    for check in (envs.log_level, envs.check_values, lambda: envs.get("DEEPINFER_LOG_LEVEL")):
        with pytest.raises(ValueError, match=re.escape(message)):
            check()
    with pytest.raises(ValueError, match=re.escape(message)):  # before any checkpoint is looked at
        LLM(model="/nonexistent/checkpoint", accelerator="cpu")
    assert serve(["--port", "0"]) == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_a_boolean_variable_that_is_not_one_stops_the_engine_at_start_up(clean_env):
    from deepinfer import LLM

    clean_env.setenv("DEEPINFER_CPU_NATIVE", "maybe")
    with pytest.raises(ValueError, match=r"invalid environment: DEEPINFER_CPU_NATIVE='maybe' is not a boolean"):
        LLM(model="/nonexistent/checkpoint", accelerator="cpu")
