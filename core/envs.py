"""Every environment variable deepinfer reads, in one place, each documented.

Nothing else in the code base reads `os.environ` for a `DEEPINFER_*` variable: it calls `get()`
here. There are two kinds:

- the core's own variables, declared below (`VARIABLES`); those with a `field` set that field of
  the engine config (`engine_overrides`);
- a feature's variables, declared on its `FeatureSpec.env_vars`, each setting a field of that
  feature's config (`feature_overrides`). This module reads the declarations from the installed
  feature plugins (`feature_variables`), so it knows them before any engine is built.

Setting a variable of a feature this installation cannot give is an error, never silently
ignored: one that configures an installed feature the caller did not list, or one that the seeds'
deployments set for a feature this release does not have (`NOT_IN_THIS_RELEASE`). Any other
unknown `DEEPINFER_*` variable draws a warning with the closest documented name (`warn_unknown`).
"""
from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, what it does, and the config field it sets, if any (an
    `EngineConfig` field for the core's variables, a field of the feature's config model for a
    variable on a `FeatureSpec`), with the kind its value is converted to (str, int or bool) and,
    for a str, the values it may take.

    `enables_feature` (feature variables): "when_set", setting the variable turns its feature on;
    "when_true" (booleans), only a true value does, while a false one just configures the feature
    when something else turns it on (a config table, another variable): a variable that chooses
    a mode of the feature must not switch the whole feature on by saying "not this mode"."""

    name: str
    doc: str
    field: str | None = None
    kind: type = str
    choices: tuple[str, ...] = ()  # the values a str variable may take (case-insensitive); () = any
    enables_feature: Literal["when_set", "when_true"] = "when_set"


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: The core's own variables (engine settings, back-end switches, paths).
VARIABLES: dict[str, EnvVar] = {v.name: v for v in [
    EnvVar("DEEPINFER_ACCELERATOR",
           "Back end to use: cpu, nvidia, ascend, or a third-party plugin's name. Unset: the one "
           "usable accelerator, else cpu with a warning.", field="accelerator"),
    EnvVar("DEEPINFER_CONFIG", "Path of a TOML engine configuration file (same as --config)."),
    EnvVar("DEEPINFER_HF_MODEL_DIR",
           "Local checkpoint directory that replaces the *default* model; an explicitly given model "
           "always wins."),
    EnvVar("DEEPINFER_CACHE_DIR",
           "Where deepinfer keeps generated files: the embedded default model (models/) and the cpu back "
           "end's compiled kernels (cpu_native/); default ~/.cache/deepinfer. Each is a private store, "
           "created 0700 and refused unless it is yours and writable by nobody else (deepinfer.private_store)."),
    EnvVar("DEEPINFER_CPU_NATIVE",
           "cpu back end: 1 (default) compiles and uses the C kernels (element-wise, decode-sized "
           "products incl. AMX tiles where the CPU has them, decode attention, MoE dispatch/combine, "
           "greedy sampling; needs a C compiler, else a warning and the torch kernels); 0 uses the "
           "pure-torch kernels.", kind=bool),
    EnvVar("DEEPINFER_CPU_NATIVE_ISA",
           "cpu back end: which instruction sets the C kernels are built for. native (default): all "
           "that -march=native offers; no-amx: no AMX tiles; no-avx512bf16: no AVX512-BF16 and no "
           "AMX (AVX2/FMA dot products); no-avx512: what an AVX2 CPU builds, -march=x86-64-v3 (AVX2/FMA "
           "dot products, no AVX-512); no-avx2: what a CPU without AVX2 builds, -march=x86-64-v2 (the "
           "plain C loops). A CPU below a switch's x86-64 level builds for itself with those sets "
           "masked off. For testing the lower tiers on a bigger CPU (with ATEN_CPU_CAPABILITY=avx2 "
           "ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 to emulate an AVX2 CPU), or avoiding a "
           "broken path."),
    EnvVar("DEEPINFER_CPU_PACKED_WEIGHTS",
           "cpu back end: 1 (default) keeps packed copies of the bf16 weights that linears read, "
           "each made at load (the model gives its weights by the op that reads them) where a kernel of "
           "this CPU's tier reads it: the C register tiles' for decode batches (AVX512-BF16: 1-64 rows; "
           "with AMX 1-6, then AMX tiles and oneDNN; AVX2+FMA: every multi-row product) and oneDNN's blocked one "
           "for the other multi-row products (each 1.1-3.7x faster, each costs the weights' size "
           "again in RAM), the tiles' copies of the bf16 routed expert stacks (decode batches of several "
           "rows per expert, AVX2 prefill) and the mHC sites' fn transposed (bf16 batches of 4+ rows); "
           "0 uses the plain weights only.", kind=bool),
    EnvVar("DEEPINFER_CPU_HUGE_PAGES",
           "cpu back end: 1 (default) puts the packed weight copies on memory advised for transparent huge "
           "pages (madvise; Linux), and once the engine is built advises the process's anonymous memory "
           "(weights, cache, heap) and collapses what is resident (up to 1 GiB), so that decode reads it "
           "without a prefetch stop and a TLB miss every 4 KB; 0 allocates the copies as any tensor and "
           "advises nothing.", kind=bool),
    EnvVar("DEEPINFER_CPU_DECODE_BLOCKS",
           "cpu back end: 1 (default) runs a model's decode steps (up to 64 tokens) as their prepared programs: "
           "the calls it has C kernels for checked and bound once, without the Python between them; 0 runs the "
           "programs call by call. The same bits either way. Read once, when the back end is created.", kind=bool),
    EnvVar("DEEPINFER_CPU_QUANTIZED_WEIGHTS",
           "cpu back end: 1 keeps a checkpoint's FP8/FP4 linear and expert weights quantised in memory "
           "(about the checkpoint's bytes; products of up to 128 rows run on the stored codes in C, larger "
           "ones dequantise tile by tile); 0 (default) dequantises them at load.", kind=bool),
    EnvVar("DEEPINFER_LOG_LEVEL", "Logging level of `deepinfer serve` (default INFO): DEBUG, INFO, WARNING, ERROR "
           "or CRITICAL (any case); another value is an error when an engine or the server starts.",
           choices=LOG_LEVELS),
    EnvVar("DEEPINFER_API_KEY",
           "deepinfer serve: the API key every route but /health requires (`Authorization: Bearer "
           "<key>`), when --api-key is not given. Unset: no key. Set but empty (a deploy script's unset "
           "$KEY): refused at start-up, unlike other variables, whose empty value counts as unset."),
]}

#: Variables the seeds' deployments set for features this release does not implement, with what
#: they would configure. No installed feature declares them, so setting one is refused with an
#: error that says so (a plugin that provides the feature declares the variable and takes it over).
#: (DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS was one until the eplb feature declared it.)
NOT_IN_THIS_RELEASE: dict[str, str] = {}


def feature_variables() -> dict[str, tuple[str, EnvVar]]:
    """The variables the installed feature plugins declare: name -> (feature, declaration).

    Read from the plugins' specs on every call (a plugin may be installed while a process runs);
    a plugin that fails to load declares nothing.
    """
    from deepinfer.plugins import feature_specs  # imported here: deepinfer.plugins imports this module

    specs, _ = feature_specs()
    return {var.name: (name, var) for name, (_, spec) in specs.items() for var in spec.env_vars}


def _declaration(name: str) -> EnvVar:
    if name in VARIABLES:
        return VARIABLES[name]
    declared = feature_variables().get(name)
    if declared is None:
        raise KeyError(f"{name} is not a documented deepinfer environment variable; declare it in envs.py "
                       f"(core) or on the FeatureSpec of the feature it configures")
    return declared[1]


def _raw(name: str) -> str | None:
    value = os.environ.get(name, "")
    return value if value != "" else None


def get(name: str, default: str | None = None) -> str | None:
    """The raw value of a documented variable, the core's or an installed feature's (empty strings
    count as unset). Raises KeyError for any other name: a typo in the code, not in the environment;
    ValueError for a value outside the variable's `choices`."""
    var = _declaration(name)
    value = _raw(name)
    if value is not None and var.choices:
        _convert(var, value)  # ValueError for a value outside its choices
    return default if value is None else value


def get_verbatim(name: str) -> str | None:
    """A documented variable's value exactly as set, the empty string included; None only when it
    is not set. For a variable whose empty value must not pass for unset (DEEPINFER_API_KEY)."""
    _declaration(name)
    return os.environ.get(name)


def get_bool(name: str, default: bool) -> bool:
    """A documented boolean variable (1/0, true/false, yes/no, on/off); `default` when unset."""
    var = _declaration(name)
    raw = _raw(name)
    return default if raw is None else _convert(var, raw)


def _convert(var: EnvVar, raw: str):
    if var.kind is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{var.name}={raw!r} is not a boolean; use 1 or 0")
    if var.kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{var.name}={raw!r} is not an integer") from None
    if var.choices and raw.strip().upper() not in var.choices:
        raise ValueError(f"{var.name}={raw!r} is not valid; use one of {', '.join(var.choices)}")
    return raw


def log_level(default: str = "INFO") -> int:
    """DEEPINFER_LOG_LEVEL as a `logging` level (`default` when unset); ValueError for another value."""
    return getattr(logging, get("DEEPINFER_LOG_LEVEL", default).strip().upper())


def check_values() -> None:
    """ValueError naming every set core variable whose value its kind refuses (a bool that is not
    1/0, a log level that is not one), so that a bad value stops an engine at start-up rather than
    being read, or ignored, later."""
    problems = []
    for var in VARIABLES.values():
        raw = _raw(var.name)
        if raw is not None and (var.kind is not str or var.choices):
            try:
                _convert(var, raw)
            except ValueError as e:
                problems.append(str(e))
    if problems:
        raise ValueError("invalid environment: " + "; ".join(problems))


def engine_overrides() -> dict:
    """Engine config fields set through the environment."""
    return {v.field: _convert(v, _raw(v.name)) for v in VARIABLES.values()
            if v.field and _raw(v.name) is not None}


def feature_overrides(installed_features: set[str], enabled_features: set[str] = frozenset()) -> dict[str, dict]:
    """Feature config fields set through the environment, per feature, as the features' specs
    declare them. A feature appears when one of its set variables turns it on or it is in
    `enabled_features` (turned on otherwise, e.g. by a config table); variables that only
    configure it (`EnvVar.enables_feature`) leave a feature that is off out.

    Raises ValueError for a set variable that configures a feature outside `installed_features`,
    or one in `NOT_IN_THIS_RELEASE` that no installed feature declares: the user asked for
    behaviour this installation cannot give, and ignoring it would hide that.
    """
    declared = feature_variables()
    for name, what in NOT_IN_THIS_RELEASE.items():
        if name not in declared and _raw(name) is not None:
            raise ValueError(f"{name} is set, but it configures {what}, which is not available in this release "
                             f"of deepinfer (no installed feature plugin declares {name}). Unset {name}.")
    out: dict[str, dict] = {}
    turned_on = set(enabled_features)
    for name, (feature, var) in declared.items():
        raw = _raw(name)
        if raw is None:
            continue
        if feature not in installed_features:
            raise ValueError(
                f"{name} is set, but it configures the feature '{feature}', which is not available in this "
                f"installation (installed features: {sorted(installed_features) or 'none'}). Unset {name}.")
        value = _convert(var, raw)
        out.setdefault(feature, {})[var.field] = value
        if var.enables_feature == "when_set" or value is True:
            turned_on.add(feature)
    return {feature: fields for feature, fields in out.items() if feature in turned_on}


_warned: set[str] = set()


def warn_unknown() -> list[str]:
    """Warn (once per name and process) about set `DEEPINFER_*` variables that deepinfer does not
    read, with the closest documented name: a misspelt variable would otherwise be silently
    ignored. The installed features' variables are documented names; the seeds' variables of
    features this release lacks are not warned about (`feature_overrides` refuses them). Returns
    the unknown names."""
    candidates = sorted(k for k in os.environ if k.startswith("DEEPINFER_") and k not in VARIABLES
                        and k not in NOT_IN_THIS_RELEASE)
    if not candidates:
        return []
    documented = [*VARIABLES, *feature_variables()]
    unknown = [name for name in candidates if name not in documented]
    for name in unknown:
        if name in _warned:
            continue
        _warned.add(name)
        close = difflib.get_close_matches(name, documented, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "`deepinfer doctor` lists the documented variables"
        logging.getLogger("deepinfer").warning("the environment variable %s is not one deepinfer reads, so it has "
                                               "no effect; %s", name, hint)
    return unknown


def describe() -> str:
    """Every documented variable with its meaning, the installed features' included (for
    `deepinfer doctor`)."""
    lines = [f"{v.name}: {v.doc}" for v in VARIABLES.values()]
    lines += [f"{v.name}: feature {feature}: {v.doc}" for feature, v in feature_variables().values()]
    return "\n".join(lines)
