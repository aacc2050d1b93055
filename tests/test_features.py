"""Feature plugins: discovery, per-feature config, start-up validation, hook checking."""
from __future__ import annotations

import pluggy
import pytest

from deepinfer.accelerator.interface import Capabilities
from deepinfer.config import load_config
from deepinfer.plugins import PluginError, load_features

FEATURES = '''
from pydantic import BaseModel, ConfigDict
import deepinfer
from deepinfer.features import FeatureSpec


class DemoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: int = 1


class Demo:
    @staticmethod
    @deepinfer.hookimpl
    def deepinfer_feature_spec():
        return FeatureSpec(name="demo", config_model=DemoConfig,
                           hooks=("deepinfer_logits_processor", "deepinfer_validate_config"),
                           slots=("draft_proposer",))

    @staticmethod
    @deepinfer.hookimpl
    def deepinfer_logits_processor(engine, feature_config):
        return ("processor-of-demo", feature_config.level)

    @staticmethod
    @deepinfer.hookimpl
    def deepinfer_validate_config(config, feature_config):
        return ["level 13 is unlucky; pick another level"] if feature_config.level == 13 else None


class Greedy:
    @staticmethod
    @deepinfer.hookimpl
    def deepinfer_feature_spec():
        return FeatureSpec(name="greedy", config_model=DemoConfig, hooks=(), slots=("draft_proposer",),
                           required_capabilities=("graph_capture",), requires=("missing_feature",))


class Typo:
    @staticmethod
    @deepinfer.hookimpl
    def deepinfer_feature_spec():
        return FeatureSpec(name="typo", config_model=DemoConfig, hooks=())

    @staticmethod
    @deepinfer.hookimpl
    def deepinfer_logit_processor(engine):  # misspelled on purpose
        return None


demo, greedy, typo = Demo(), Greedy(), Typo()
'''


class FakeAccelerator:
    def capabilities(self):
        return Capabilities(name="fake", device_type="cpu")


@pytest.fixture
def feature_dist(fake_distribution):
    fake_distribution("demo-features", "1.0", {"deepinfer.features": {
        "demo": "demo_features:demo", "greedy": "demo_features:greedy", "typo": "demo_features:typo"}},
        {"demo_features": FEATURES})


def test_enabled_feature_gets_its_own_config(feature_dist, clean_env):
    cfg = load_config({"features": {"demo": {"level": 4}}})
    fs = load_features(cfg, FakeAccelerator())
    assert list(fs.specs) == ["demo"]
    fs.start(engine=object())
    assert fs.processors == [("processor-of-demo", 4)]


def test_disabled_features_are_not_registered(feature_dist, clean_env):
    fs = load_features(load_config(), FakeAccelerator())
    assert "demo" not in fs.specs and "greedy" not in fs.specs


def test_all_problems_reported_at_once(feature_dist, clean_env):
    cfg = load_config({"features": {"demo": {"level": 13}, "greedy": {}}})
    with pytest.raises(PluginError) as e:
        load_features(cfg, FakeAccelerator())
    msg = str(e.value)
    assert "graph_capture" in msg  # capability
    assert "missing_feature" in msg  # requires
    assert "both claim the 'draft_proposer' slot" in msg  # slot
    assert "unlucky" in msg  # the feature's own validate hook


def test_misspelled_hook_is_an_error(feature_dist, clean_env):
    with pytest.raises(pluggy.PluginValidationError, match="deepinfer_logit_processor"):
        load_features(load_config({"features": {"typo": {}}}), FakeAccelerator())


def test_bad_feature_key(feature_dist, clean_env):
    with pytest.raises(ValueError, match="features.demo.levl"):
        load_features(load_config({"features": {"demo": {"levl": 1}}}), FakeAccelerator())
