"""Feature declaration (`FeatureSpec`) and start-up validation of the enabled combination."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from deepinfer.accelerator.interface import Capabilities
from deepinfer.envs import VARIABLES, EnvVar


class FeatureSpec(BaseModel):
    """What a feature plugin declares about itself, as data.

    The core checks every enabled feature against the back end's capabilities and against the
    other enabled features, and reports *all* problems at once.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    name: str  # the config key: [features.<name>], and the entry-point name
    config_model: type[BaseModel]  # pydantic model with extra="forbid"; the plugin class gets an instance
    hooks: tuple[str, ...]  # hook names the plugin class implements (checked when it is registered)
    env_vars: tuple[EnvVar, ...] = ()  # environment variables, each setting a field of config_model
    required_capabilities: tuple[str, ...] = ()  # Capabilities fields that must be truthy
    requires: tuple[str, ...] = ()  # other features that must be enabled
    conflicts: tuple[str, ...] = ()  # features that must not be enabled together with this one
    before: tuple[str, ...] = ()  # run before these features (hook and processor order)
    after: tuple[str, ...] = ()
    slots: tuple[str, ...] = ()  # single-owner slots, e.g. "draft_proposer"
    supports_async_pipeline: bool = True
    enabled_by_default: bool = False  # loaded without a [features.<name>] table (lazy features)
    description: str = ""  # one line, shown by `deepinfer doctor`

    @model_validator(mode="after")
    def _check_env_vars(self) -> FeatureSpec:
        for var in self.env_vars:
            if not var.name.startswith("DEEPINFER_") or var.name in VARIABLES:
                raise ValueError(f"feature '{self.name}': environment variable {var.name} must start with "
                                 f"DEEPINFER_ and must not be one of the core's variables")
            if var.field not in self.config_model.model_fields:
                raise ValueError(f"feature '{self.name}': environment variable {var.name} sets field "
                                 f"{var.field!r}, which {self.config_model.__name__} does not have")
            if var.kind not in (str, int, bool):
                raise ValueError(f"feature '{self.name}': environment variable {var.name} has kind "
                                 f"{var.kind!r}; use str, int or bool")
            if var.enables_feature == "when_true" and var.kind is not bool:
                raise ValueError(f"feature '{self.name}': environment variable {var.name} turns the feature on "
                                 f"only when true, which needs kind bool")
        return self


def validate_features(specs: dict[str, FeatureSpec], capabilities: Capabilities,
                      async_pipeline: bool) -> list[str]:
    """Every problem with the enabled feature set, as sentences that name the fix. (Whether each
    plugin implements the hooks its spec lists is checked when it is registered: `FeatureSet`.)"""
    problems: list[str] = []
    owners: dict[str, str] = {}
    for name, spec in specs.items():
        for cap in spec.required_capabilities:
            if not getattr(capabilities, cap, False):
                problems.append(f"feature '{name}' needs the back-end capability '{cap}', which accelerator "
                                f"'{capabilities.name}' does not declare; disable the feature or choose another back end")
        for req in spec.requires:
            if req not in specs:
                problems.append(f"feature '{name}' requires feature '{req}'; enable [features.{req}]")
        for other in spec.conflicts:
            if other in specs:
                problems.append(f"features '{name}' and '{other}' cannot be enabled together; disable one of them")
        for slot in spec.slots:
            if slot in owners:
                problems.append(f"features '{owners[slot]}' and '{name}' both claim the '{slot}' slot; enable only one")
            owners[slot] = name
        if async_pipeline and not spec.supports_async_pipeline:
            problems.append(f"feature '{name}' does not support the async pipeline; set async_pipeline=false")
    return problems


def order_features(specs: dict[str, FeatureSpec]) -> list[str]:
    """Names in an order that honours every before/after constraint (stable otherwise)."""
    edges: dict[str, set[str]] = {n: set() for n in specs}  # n -> must come after these
    for name, spec in specs.items():
        for b in spec.before:
            if b in edges:
                edges[b].add(name)
        for a in spec.after:
            if a in specs:
                edges[name].add(a)
    ordered: list[str] = []
    pending = list(specs)
    while pending:
        ready = [n for n in pending if edges[n] <= set(ordered)]
        if not ready:
            raise ValueError(f"feature ordering has a cycle among {sorted(pending)}")
        ordered.append(ready[0])
        pending.remove(ready[0])
    return ordered
