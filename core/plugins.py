"""Plugin discovery, loading and selection: a typed facade over entry points and pluggy.

- Discovery uses `importlib.metadata` entry points (groups `deepinfer.accelerators` and
  `deepinfer.features`); listing never imports a plugin. (The design card names the
  `entrypoints` package, which is in maintenance-only mode and itself recommends
  `importlib.metadata`; pluggy uses the same API.)
- Accelerators: only the selected one is imported. Every failure is loud and carries the fix;
  there is never a silent fallback to another back end.
- Features: each installed feature plugin (a class) is imported to read its `FeatureSpec`
  (feature modules must be import-light); each engine registers one instance per enabled
  feature, made with that feature's config, with its own pluggy plugin manager (hookspecs.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any

import pluggy
from pydantic import BaseModel

from deepinfer import envs, hookspecs
from deepinfer.accelerator.interface import INTERFACE_VERSION, Accelerator, ProbeResult, interface_compatible
from deepinfer.features import FeatureSpec, order_features, validate_features
from deepinfer.hookspecs import EngineContext

if TYPE_CHECKING:
    from deepinfer.config import EngineConfig
    from deepinfer.engine.engine_core import EngineCore
    from deepinfer.logits_processor import LogitsProcessor

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


def _one(group: str, name: str, registry: dict[str, list[PluginInfo]] | None = None) -> PluginInfo:
    registry = discover(group) if registry is None else registry
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


def _plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


class FeatureCatalog:
    """Feature plugins (classes) and the FeatureSpec each declares.

    `deepinfer_feature_spec` is called historically on the catalogue's plugin manager when the
    catalogue is made, so each plugin is asked for its spec when it is added, whenever that is.
    """

    def __init__(self) -> None:
        self.plugins: dict[str, tuple[Any, FeatureSpec]] = {}  # name -> (plugin class, spec)
        self._pm = _plugin_manager()
        self._declared: list[FeatureSpec] = []
        self._pm.hook.deepinfer_feature_spec.call_historic(result_callback=self._declared.append)

    def add(self, name: str, plugin: Any, where: str | None = None) -> FeatureSpec:
        """Register a feature plugin under its entry-point name and return its spec. `where`
        names it in errors (default: the name)."""
        where = where or f"'{name}'"
        if not callable(plugin):
            raise PluginError(f"feature plugin {where} must be a class: each engine that enables the feature "
                              f"makes one instance of it with the feature's config (got {plugin!r})")
        self._declared.clear()
        try:
            self._pm.register(plugin, name=name)  # historic: its deepinfer_feature_spec runs now
        except Exception as exc:
            raise PluginError(f"feature plugin {where} could not be registered: {type(exc).__name__}: {exc}") from exc
        spec = self._declared[0] if len(self._declared) == 1 else None
        if not isinstance(spec, FeatureSpec) or spec.name != name:
            raise PluginError(f"feature plugin {where} must return a FeatureSpec named '{name}' "
                              f"from deepinfer_feature_spec()")
        taken = {var.name: other for other, (_, declared) in self.plugins.items() for var in declared.env_vars}
        for var in spec.env_vars:
            if var.name in taken:
                raise PluginError(f"feature plugin {where} declares the environment variable {var.name}, which "
                                  f"feature '{taken[var.name]}' already declares; uninstall one of them")
        self.plugins[name] = (plugin, spec)
        return spec


def feature_specs() -> tuple[dict[str, tuple[Any, FeatureSpec]], dict[str, str]]:
    """Import every installed feature plugin: name -> (plugin class, spec); and name -> load error."""
    catalog, errors = FeatureCatalog(), {}
    registry = discover(FEATURE_GROUP)
    for name in registry:
        try:
            info = _one(FEATURE_GROUP, name, registry)
            catalog.add(name, _load(info), info.describe())
        except PluginError as exc:
            errors[name] = str(exc)
    return catalog.plugins, errors


class FeatureSet:
    """The enabled features of one engine: one plugin instance per feature, made from the
    feature's plugin class with its validated config, registered with this engine's plugin
    manager. `hook` calls every enabled feature, in feature order."""

    def __init__(self, specs: dict[str, FeatureSpec], configs: dict[str, BaseModel], plugins: dict[str, Any]):
        self.order = order_features(specs)
        self.specs = {n: specs[n] for n in self.order}
        self.configs = {n: configs[n] for n in self.order}
        self.pm = _plugin_manager()
        for name in reversed(self.order):  # pluggy calls the last registered first
            try:
                instance = plugins[name](self.configs[name])
            except Exception as exc:
                raise PluginError(f"feature '{name}' could not be set up with its config: "
                                  f"{type(exc).__name__}: {exc}") from exc
            self.pm.register(instance, name=name)
        self.pm.check_pending()  # a misspelled hook implementation is an error, not a no-op
        self.hook = self.pm.hook
        self.context: EngineContext | None = None
        self.processors: list[LogitsProcessor] = []
        self.draft_proposer: Any = None

    def validate(self, config: EngineConfig) -> list[str]:
        """Hooks a spec lists that its plugin does not implement, and the features' own checks."""
        problems = []
        for name, spec in self.specs.items():
            implemented = {caller.name for caller in self.pm.get_hookcallers(self.pm.get_plugin(name)) or ()}
            problems += [f"feature '{name}' declares hook '{hook}' but its plugin does not implement it (a method "
                         f"marked @deepinfer.hookimpl)" for hook in spec.hooks if hook not in implemented]
        return problems + [p for found in self.hook.deepinfer_validate_config(config=config) for p in found]

    def start(self, engine: EngineCore) -> None:
        """Collect the objects the features contribute to `engine`."""
        self.context = EngineContext.of(engine)
        self.hook.deepinfer_engine_start(engine=self.context)
        self.processors = self.hook.deepinfer_logits_processor(engine=self.context)
        self.draft_proposer = self.hook.deepinfer_draft_proposer(engine=self.context)

    def shutdown(self, engine: EngineCore) -> None:
        self.hook.deepinfer_engine_shutdown(engine=self.context or EngineContext.of(engine))


def load_features(config: EngineConfig, accelerator: Accelerator) -> FeatureSet:
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
    problems = validate_features(specs, caps, config.async_pipeline)
    feature_set = FeatureSet(specs, configs, {n: available[n][0] for n in specs})
    problems += feature_set.validate(config)
    if problems:
        raise PluginError("invalid feature combination:\n" + "\n".join(f"  {p}" for p in problems))
    return feature_set
