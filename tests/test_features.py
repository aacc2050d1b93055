"""Feature plugins: discovery, per-engine plugin instances, hook semantics (order, firstresult,
historic), start-up validation, hook checking."""
from __future__ import annotations

from types import SimpleNamespace

import pluggy
import pytest
from pydantic import BaseModel

import deepinfer
from deepinfer.accelerator.interface import Capabilities
from deepinfer.config import load_config
from deepinfer.features import FeatureSpec
from deepinfer.hookspecs import EngineContext
from deepinfer.plugins import FeatureCatalog, PluginError, load_features

FEATURES = '''
from pydantic import BaseModel, ConfigDict
import deepinfer
from deepinfer.features import FeatureSpec

CALLS = []  # (feature, hook) in call order


class DemoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: int = 1


class Demo:
    def __init__(self, config):
        self.config = config

    @staticmethod
    @deepinfer.hookimpl
    def deepinfer_feature_spec():
        return FeatureSpec(name="demo", config_model=DemoConfig,
                           hooks=("deepinfer_logits_processor", "deepinfer_validate_config"),
                           slots=("draft_proposer",))

    @deepinfer.hookimpl
    def deepinfer_logits_processor(self, engine):
        return ("processor-of-demo", self.config.level, engine.vocab_size)

    @deepinfer.hookimpl
    def deepinfer_validate_config(self, config):
        return ["feature 'demo': level 13 is unlucky; pick another level"] if self.config.level == 13 else None


class Greedy:
    def __init__(self, config):
        pass

    @staticmethod
    @deepinfer.hookimpl
    def deepinfer_feature_spec():
        return FeatureSpec(name="greedy", config_model=DemoConfig, hooks=(), slots=("draft_proposer",),
                           required_capabilities=("graph_capture",), requires=("missing_feature",))


class Unmarked:
    def __init__(self, config):
        pass

    @staticmethod
    @deepinfer.hookimpl
    def deepinfer_feature_spec():
        return FeatureSpec(name="unmarked", config_model=DemoConfig, hooks=("deepinfer_logits_processor",))

    def deepinfer_logits_processor(self, engine):  # @deepinfer.hookimpl forgotten
        return "never collected"


class Typo:
    def __init__(self, config):
        pass

    @staticmethod
    @deepinfer.hookimpl
    def deepinfer_feature_spec():
        return FeatureSpec(name="typo", config_model=DemoConfig, hooks=())

    @deepinfer.hookimpl
    def deepinfer_logit_processor(self, engine):  # misspelled on purpose
        return None


def chain_member(name, before, proposes):
    """A feature that runs before `before`, contributes a processor, and a draft proposer if `proposes`."""
    class Member:
        def __init__(self, config):
            pass

        @staticmethod
        @deepinfer.hookimpl
        def deepinfer_feature_spec():
            return FeatureSpec(name=name, config_model=DemoConfig, before=before,
                               hooks=("deepinfer_logits_processor", "deepinfer_draft_proposer"))

        @deepinfer.hookimpl
        def deepinfer_logits_processor(self, engine):
            CALLS.append((name, "processor"))
            return f"processor-of-{name}"

        @deepinfer.hookimpl
        def deepinfer_draft_proposer(self, engine):
            CALLS.append((name, "proposer"))
            return f"proposer-of-{name}" if proposes else None
    return Member


# abstain runs before first, first before second
abstain = chain_member("abstain", ("first",), proposes=False)
first = chain_member("first", ("second",), proposes=True)
second = chain_member("second", (), proposes=True)

legacy = Demo(DemoConfig())  # an instance, as plugins were before: each engine needs its own
'''


class FakeAccelerator:
    def capabilities(self):
        return Capabilities(name="fake", device_type="cpu")


@pytest.fixture
def feature_dist(fake_distribution):
    fake_distribution("demo-features", "1.0", {"deepinfer.features": {
        "demo": "demo_features:Demo", "greedy": "demo_features:Greedy", "unmarked": "demo_features:Unmarked",
        "typo": "demo_features:Typo", "abstain": "demo_features:abstain", "first": "demo_features:first",
        "second": "demo_features:second", "legacy": "demo_features:legacy"}},
        {"demo_features": FEATURES})


def fake_engine():
    """The attributes of an EngineCore that EngineContext.of reads, and nothing else."""
    return SimpleNamespace(config=None, accelerator=FakeAccelerator(), model=None, tokenizer=None, vocab_size=32,
                           eos_token_ids={1}, max_model_len=16, cache=None, runner=None,
                           scheduler=SimpleNamespace(max_num_seqs=2, max_num_batched_tokens=64),
                           sampler=SimpleNamespace(generator=None))


def test_enabled_feature_gets_its_own_config(feature_dist, clean_env):
    cfg = load_config({"features": {"demo": {"level": 4}}})
    fs = load_features(cfg, FakeAccelerator())
    assert list(fs.specs) == ["demo"]
    fs.start(fake_engine())
    assert fs.processors == [("processor-of-demo", 4, 32)]
    assert isinstance(fs.context, EngineContext) and fs.context.max_num_seqs == 2


def test_each_engine_gets_its_own_plugin_instance(feature_dist, clean_env):
    a = load_features(load_config({"features": {"demo": {"level": 2}}}), FakeAccelerator())
    b = load_features(load_config({"features": {"demo": {"level": 3}}}), FakeAccelerator())
    assert a.pm.get_plugin("demo") is not b.pm.get_plugin("demo")
    assert (a.pm.get_plugin("demo").config.level, b.pm.get_plugin("demo").config.level) == (2, 3)


def test_hooks_run_in_feature_order(feature_dist, clean_env):
    import demo_features

    demo_features.CALLS.clear()
    fs = load_features(load_config({"features": {"second": {}, "first": {}, "abstain": {}}}), FakeAccelerator())
    assert list(fs.specs) == ["abstain", "first", "second"]
    fs.start(fake_engine())
    assert fs.processors == ["processor-of-abstain", "processor-of-first", "processor-of-second"]


def test_firstresult_hook_stops_at_the_first_non_none_result(feature_dist, clean_env):
    import demo_features

    fs = load_features(load_config({"features": {"second": {}, "first": {}, "abstain": {}}}), FakeAccelerator())
    demo_features.CALLS.clear()
    fs.start(fake_engine())
    assert fs.draft_proposer == "proposer-of-first"
    proposers = [name for name, hook in demo_features.CALLS if hook == "proposer"]
    assert proposers == ["abstain", "first"]  # abstain returned None; second was never asked


def test_feature_spec_hook_is_historic_and_reaches_a_plugin_added_later():
    asked = []

    class Late:
        @staticmethod
        @deepinfer.hookimpl
        def deepinfer_feature_spec():
            asked.append("late")
            return FeatureSpec(name="late", config_model=BaseModel, hooks=())

    catalog = FeatureCatalog()  # deepinfer_feature_spec is called here, before Late is registered
    assert asked == []
    spec = catalog.add("late", Late)
    assert asked == ["late"] and spec.name == "late" and catalog.plugins == {"late": (Late, spec)}


def test_a_plugin_instance_instead_of_a_class_is_refused(feature_dist):
    from deepinfer.plugins import feature_specs

    specs, errors = feature_specs()
    assert "must be a class" in errors["legacy"] and "legacy" not in specs and "demo" in specs


def test_disabled_features_are_not_registered(feature_dist, clean_env):
    fs = load_features(load_config(), FakeAccelerator())
    assert "demo" not in fs.specs and "greedy" not in fs.specs


def test_all_problems_reported_at_once(feature_dist, clean_env):
    cfg = load_config({"features": {"demo": {"level": 13}, "greedy": {}, "unmarked": {}}})
    with pytest.raises(PluginError) as e:
        load_features(cfg, FakeAccelerator())
    msg = str(e.value)
    assert "graph_capture" in msg  # capability
    assert "missing_feature" in msg  # requires
    assert "both claim the 'draft_proposer' slot" in msg  # slot
    assert "feature 'demo': level 13 is unlucky" in msg  # the feature's own validate hook
    assert "feature 'unmarked' declares hook 'deepinfer_logits_processor'" in msg  # no @hookimpl


def test_misspelled_hook_is_an_error(feature_dist, clean_env):
    with pytest.raises(pluggy.PluginValidationError, match="deepinfer_logit_processor"):
        load_features(load_config({"features": {"typo": {}}}), FakeAccelerator())


def test_bad_feature_key(feature_dist, clean_env):
    with pytest.raises(ValueError, match="features.demo.levl"):
        load_features(load_config({"features": {"demo": {"levl": 1}}}), FakeAccelerator())
