"""Every environment variable deepinfer reads, in one place, each documented.

Nothing else in the code base reads `os.environ` for a `DEEPINFER_*` variable: it calls `get()`
here. Variables that configure a feature map onto that feature's config fields; setting one whose
feature is not installed is an error (`feature_overrides`), never silently ignored.
"""
from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    doc: str
    feature: str | None = None  # feature plugin whose config this sets
    field: str | None = None  # config field (engine field when feature is None)
    kind: type = str


VARIABLES: dict[str, EnvVar] = {v.name: v for v in [
    EnvVar("DEEPINFER_ACCELERATOR",
           "Back end to use: cpu, nvidia, ascend, or a third-party plugin's name. Unset: the one "
           "usable accelerator, else cpu with a warning.", field="accelerator"),
    EnvVar("DEEPINFER_CONFIG", "Path of a TOML engine configuration file (same as --config)."),
    EnvVar("DEEPINFER_HF_MODEL_DIR",
           "Local checkpoint directory that replaces the *default* model; an explicitly given model "
           "always wins."),
    EnvVar("DEEPINFER_CACHE_DIR",
           "Where deepinfer keeps generated files such as the embedded default model "
           "(default ~/.cache/deepinfer)."),
    EnvVar("DEEPINFER_CPU_NATIVE",
           "cpu back end: 1 (default) compiles and uses the C kernels (element-wise, decode-sized "
           "products incl. AMX tiles where the CPU has them, decode attention, MoE dispatch/combine, "
           "greedy sampling; needs a C compiler, else a warning and the torch kernels); 0 uses the "
           "pure-torch kernels.", kind=bool),
    EnvVar("DEEPINFER_CPU_NATIVE_ISA",
           "cpu back end: which instruction sets the C kernels are built for. native (default): all "
           "that -march=native offers; no-amx: no AMX tiles; no-avx512bf16: no AVX512-BF16 and no "
           "AMX (the portable dot products); no-avx512: no AVX-512 at all (AVX2/FMA or older). For "
           "testing the lower tiers on a bigger CPU, or avoiding a broken path."),
    EnvVar("DEEPINFER_CPU_PACKED_WEIGHTS",
           "cpu back end: 1 (default) keeps a oneDNN-blocked copy of each bf16 weight that a "
           "multi-row linear reads (made at its second such use; 1.3x faster from 2 rows up, "
           "costs the weights' size again in RAM); 0 uses the plain weights only.", kind=bool),
    EnvVar("DEEPINFER_LOG_LEVEL", "Logging level of the `deepinfer` logger (default WARNING)."),
    EnvVar("DEEPINFER_USE_NEXTN_DECODE",
           "Maximum speculative draft length (default 5); 0 disables speculation.",
           feature="dspark", field="num_draft_tokens", kind=int),
    EnvVar("DEEPINFER_ENABLE_MTP_VARLEN",
           "1: confidence-scheduled variable-length verification.",
           feature="dspark", field="variable_length", kind=bool),
    EnvVar("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE",
           "SWA bounded replay truncation mode (e.g. compact).",
           feature="swa_replay", field="truncation_mode"),
    EnvVar("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS",
           "SWA bounded replay: prompt suffix kept for replay (must cover the window plus backtracking).",
           feature="swa_replay", field="keep_tokens", kind=int),
    EnvVar("DEEPINFER_BATCH_INVARIANT",
           "1: batch-invariant kernels and deterministic sampling.",
           feature="batch_invariant", field="enabled", kind=bool),
    EnvVar("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS",
           "Lower bound on redundant experts for expert load balancing.",
           feature="eplb", field="num_extra_experts", kind=int),
]}


def get(name: str, default: str | None = None) -> str | None:
    """The raw value of a documented variable (empty strings count as unset)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a documented deepinfer environment variable; add it to envs.py")
    value = os.environ.get(name, "")
    return value if value != "" else default


def get_bool(name: str, default: bool) -> bool:
    """A documented boolean variable (1/0, true/false, yes/no, on/off); `default` when unset."""
    raw = get(name)
    return default if raw is None else _convert(VARIABLES[name], raw)


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
    return raw


def engine_overrides() -> dict:
    """Engine config fields set through the environment."""
    return {v.field: _convert(v, get(v.name)) for v in VARIABLES.values()
            if v.feature is None and v.field and get(v.name) is not None}


def feature_overrides(installed_features: set[str]) -> dict[str, dict]:
    """Feature config fields set through the environment, per feature.

    Raises ValueError for a variable whose feature is not installed: the user asked for
    behaviour this installation cannot give, and ignoring it would hide that.
    """
    out: dict[str, dict] = {}
    for var in VARIABLES.values():
        raw = get(var.name) if var.feature else None
        if raw is None:
            continue
        if var.feature not in installed_features:
            raise ValueError(
                f"{var.name} is set, but it configures the feature '{var.feature}', which is not "
                f"available in this installation (installed features: {sorted(installed_features) or 'none'}). "
                f"Unset {var.name}.")
        out.setdefault(var.feature, {})[var.field] = _convert(var, raw)
    return out


_warned: set[str] = set()


def warn_unknown() -> list[str]:
    """Warn (once per name and process) about set `DEEPINFER_*` variables that deepinfer does not
    read, with the closest documented name: a misspelt variable would otherwise be silently
    ignored. Returns the unknown names."""
    unknown = sorted(k for k in os.environ if k.startswith("DEEPINFER_") and k not in VARIABLES)
    for name in unknown:
        if name in _warned:
            continue
        _warned.add(name)
        close = difflib.get_close_matches(name, VARIABLES, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "see `deepinfer doctor` for the documented variables"
        logging.getLogger("deepinfer").warning("the environment variable %s is not one deepinfer reads, so it has "
                                               "no effect; %s", name, hint)
    return unknown


def describe() -> str:
    """A table of every variable, for docs and `deepinfer doctor`."""
    return "\n".join(f"{v.name}: {v.doc}" for v in VARIABLES.values())
