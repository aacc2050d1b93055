"""Plugin discovery, loading and selection: a typed facade over entry points and pluggy.

- Discovery uses `importlib.metadata` entry points (groups `deepinfer.accelerators` and
  `deepinfer.features`); listing never imports a plugin. (The design card names the
  `entrypoints` package, which is in maintenance-only mode and itself recommends
  `importlib.metadata`; pluggy uses the same API.)
- Accelerators: only the selected one is imported. Every failure is loud and carries the fix;
  there is never a silent fallback to another back end.
- Features: each installed feature module is imported to read its `FeatureSpec` (feature
  modules must be import-light); only enabled features are registered with pluggy and started.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy
from pydantic import BaseModel

from deepinfer import envs, hookspecs
from deepinfer.accelerator.interface import INTERFACE_VERSION, Accelerator, ProbeResult, interface_compatible
from deepinfer.features import FeatureSpec, order_features, validate_features

ACCELERATOR_GROUP = "deepinfer.accelerators"
FEATURE_GROUP = "deepinfer.features"
logger = logging.getLogger("deepinfer")


class PluginError(RuntimeError):
    """A plugin could not be found, imported, or used; the message says how to fix it."""


@dataclass(frozen=True)
class PluginInfo:
    name: str
    group: str
    value: str  # "module:object"
    distribution: str
    version: str
    entry_point: Any = field(compare=False, repr=False)

    def describe(self) -> str:
        return f"'{self.name}' ({self.value}, distribution {self.distribution} {self.version})"


def discover(group: str) -> dict[str, list[PluginInfo]]:
    """name -> every distinct registration of that name in `group`, without importing anything."""
    found: dict[str, list[PluginInfo]] = {}
    seen: set[tuple[str, str, str]] = set()
    for ep in metadata.entry_points(group=group):
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else "unknown"
        key = (ep.name, ep.value, dist_name)
        if key in seen:  # the same distribution seen twice on sys.path (editable + site)
            continue
        seen.add(key)
        info = PluginInfo(ep.name, group, ep.value, dist_name, dist.version if dist else "unknown", ep)
        found.setdefault(ep.name, []).append(info)
    return found


def _one(group: str, name: str) -> PluginInfo:
    registry = discover(group)
    kind = "accelerator" if group == ACCELERATOR_GROUP else "feature"
    if name not in registry:
        installed = ", ".join(sorted(registry)) or "none"
        raise PluginError(
            f"{kind} '{name}' is not installed. Installed {kind}s: {installed}. Install the package that "
            f"provides it (pip install <package>, registering '{name}' under the entry-point group "
            f"'{group}'), or choose one of the installed names"
            + (" with DEEPINFER_ACCELERATOR=<name>." if kind == "accelerator" else "."))
    infos = registry[name]
    if len(infos) > 1:
        raise PluginError(f"{kind} '{name}' is registered by several distributions: "
                          + "; ".join(i.describe() for i in infos) + ". Uninstall all but one.")
    return infos[0]


def _load(info: PluginInfo) -> Any:
    try:
        return info.entry_point.load()
    except Exception as exc:
        raise PluginError(f"plugin {info.describe()} failed to import: {type(exc).__name__}: {exc}. "
                          f"Reinstall or fix that package, or choose another plugin.") from exc


def load_accelerator_class(name: str) -> type[Accelerator]:
    """Import exactly the named accelerator plugin and check its contract version."""
    info = _one(ACCELERATOR_GROUP, name)
    cls = _load(info)
    if not (isinstance(cls, type) and issubclass(cls, Accelerator)):
        raise PluginError(f"accelerator plugin {info.describe()} does not name a subclass of "
                          f"deepinfer.accelerator.interface.Accelerator (got {cls!r}).")
    if not interface_compatible(cls.interface_version):
        raise PluginError(
            f"accelerator plugin {info.describe()} implements accelerator interface version "
            f"{cls.interface_version}, but this deepinfer ({_version()}) provides interface version "
            f"{INTERFACE_VERSION}. Install a release of the plugin built for interface {INTERFACE_VERSION}.")
    return cls


def probe(name: str) -> tuple[ProbeResult, PluginInfo | None]:
    """Run one plugin's probe; import and contract failures become a not-usable result."""
    try:
        info = _one(ACCELERATOR_GROUP, name)
        cls = load_accelerator_class(name)
    except PluginError as exc:
        return ProbeResult(usable=False, reason=str(exc)), None
    try:
        return cls.probe(), info
    except Exception as exc:  # a probe must never raise; report it as unusable
        return ProbeResult(usable=False, reason=f"probe raised {type(exc).__name__}: {exc}"), info


def select_accelerator_class(name: str | None = None) -> type[Accelerator]:
    """The accelerator to use: `name`, else DEEPINFER_ACCELERATOR, else auto-selection."""
    name = name or envs.get("DEEPINFER_ACCELERATOR")
    if name:
        cls = load_accelerator_class(name)
        result = cls.probe()
        if not result.usable:
            usable = [n for n in sorted(discover(ACCELERATOR_GROUP)) if n != name and probe(n)[0].usable]
            raise PluginError(
                f"accelerator '{name}' is not usable on this machine: {result.reason}. Choose another back "
                f"end with DEEPINFER_ACCELERATOR=<name> (usable here: {', '.join(usable) or 'none'}), "
                f"or run `deepinfer doctor` for details.")
        return cls
    usable = [n for n in sorted(discover(ACCELERATOR_GROUP)) if n != "cpu" and probe(n)[0].usable]
    if len(usable) == 1:
        return load_accelerator_class(usable[0])
    if len(usable) > 1:
        raise PluginError(f"several accelerators are usable here ({', '.join(usable)}); "
                          f"choose one with DEEPINFER_ACCELERATOR=<name>.")
    logger.warning("DEEPINFER_ACCELERATOR is not set and no accelerator is usable; using the cpu back end.")
    return load_accelerator_class("cpu")


def select_accelerator(name: str | None = None) -> Accelerator:
    return select_accelerator_class(name)()


def _version() -> str:
    from deepinfer.version import __version__
    return __version__


# ----------------------------------------------------------------------------------------- features


def feature_specs() -> tuple[dict[str, tuple[Any, FeatureSpec]], dict[str, str]]:
    """Import every installed feature module: name -> (plugin, spec); and name -> load error."""
    plugins, errors = {}, {}
    for name, infos in discover(FEATURE_GROUP).items():
        try:
            info = _one(FEATURE_GROUP, name)
            plugin = _load(info)
            spec = plugin.deepinfer_feature_spec()
            if not isinstance(spec, FeatureSpec) or spec.name != name:
                raise PluginError(f"feature plugin {info.describe()} must return a FeatureSpec named '{name}' "
                                  f"from deepinfer_feature_spec()")
            plugins[name] = (plugin, spec)
        except PluginError as exc:
            errors[name] = str(exc)
    return plugins, errors


class FeatureSet:
    """The enabled features of one engine, registered with pluggy in dependency order."""

    def __init__(self, specs: dict[str, FeatureSpec], configs: dict[str, BaseModel], plugins: dict[str, Any]):
        self.order = order_features(specs)
        self.specs = {n: specs[n] for n in self.order}
        self.configs = configs
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        for name in self.order:
            self.pm.register(plugins[name], name=name)
        self.pm.check_pending()  # a misspelled hook implementation is an error, not a no-op
        self.hook = self.pm.hook
        self.processors: list = []
        self.draft_proposer: Any = None

    def call_each(self, hook_name: str, **kwargs) -> list[tuple[str, Any]]:
        """Call a per-feature hook on every enabled feature, passing that feature's own config."""
        results = []
        for impl in reversed(getattr(self.hook, hook_name).get_hookimpls()):  # pluggy keeps LIFO order
            args = dict(kwargs, feature_config=self.configs.get(impl.plugin_name))
            value = impl.function(**{k: args[k] for k in impl.argnames})
            if value is not None:
                results.append((impl.plugin_name, value))
        return results

    def validate(self, config) -> list[str]:
        return [f"feature '{name}': {p}" for name, problems in self.call_each("deepinfer_validate_config", config=config)
                for p in problems]

    def start(self, engine: Any) -> None:
        """Collect contributed objects and announce the engine start."""
        by_name = dict(self.call_each("deepinfer_logits_processor", engine=engine))
        self.processors = [by_name[n] for n in self.order if n in by_name]
        proposers = self.call_each("deepinfer_draft_proposer", engine=engine)
        self.draft_proposer = proposers[0][1] if proposers else None
        self.call_each("deepinfer_engine_start", engine=engine)

    def shutdown(self, engine: Any) -> None:
        self.hook.deepinfer_engine_shutdown(engine=engine)

    def config(self, name: str) -> BaseModel | None:
        return self.configs.get(name)


def load_features(config, accelerator: Accelerator) -> FeatureSet:
    """Enabled features (config tables, environment variables, default-on features), validated
    together against the back end; every problem is reported at once."""
    from deepinfer.config import resolve_feature_configs

    available, errors = feature_specs()
    requested = set(config.features)
    broken = [f"  {errors[n]}" for n in sorted(requested) if n in errors]
    if broken:
        raise PluginError("enabled features failed to load:\n" + "\n".join(broken))
    for name, message in errors.items():
        logger.warning("feature plugin '%s' is installed but failed to load (not enabled): %s", name, message)
    caps = accelerator.capabilities()
    tables = {}
    for n, (_, spec) in available.items():  # default-on features that this back end cannot host stay off
        if spec.enabled_by_default:
            missing = [c for c in spec.required_capabilities if not getattr(caps, c, False)]
            if missing:
                logger.info("feature '%s' stays off: accelerator '%s' lacks %s", n, caps.name, missing)
            else:
                tables[n] = {}
    tables.update(config.features)
    configs = resolve_feature_configs(config.model_copy(update={"features": tables}),
                                      {n: spec.config_model for n, (_, spec) in available.items()})
    configs = {n: c for n, c in configs.items() if getattr(c, "enabled", True)}
    specs = {n: available[n][1] for n in configs}
    problems = validate_features(specs, {n: available[n][0] for n in specs}, caps,
                                 config.async_pipeline)
    feature_set = FeatureSet(specs, configs, {n: available[n][0] for n in specs})
    problems += feature_set.validate(config)
    if problems:
        raise PluginError("invalid feature combination:\n" + "\n".join(f"  {p}" for p in problems))
    return feature_set
