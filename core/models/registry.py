"""Model families, keyed by config.json's `model_type`.

A family is what the engine needs to serve one kind of checkpoint:

    ModelFamily(model_type="deepseek_v4",
                parse_config=parse_config,          # (config.json dict, source) -> config
                load_checkpoint=load_checkpoint,    # (folder, dtype, config.json dict) -> (config, {name: tensor})
                model_class=DeepseekV4ForCausalLM,  # cls(config, accelerator, dtype=, device=, **options): a Model
                op_defaults=OpDefaults(required_ops=(...), model_options={"query_block": 256}),
                make_checkpoint=CheckpointMaker(...),  # optional: `deepinfer make-model --family deepseek_v4`
                aliases=("v4",))                    # optional: short names for --family

`register_model_family(family)` adds one; `get_model_family(model_type)` finds one, and an unknown
type is an `UnknownModelTypeError` (a CheckpointError) listing the supported types.
`checkpoint_family(path)` reads config.json once and picks the family from its `model_type`;
`load_model_checkpoint(path, dtype)` then runs that family's loader. The engine builder uses
nothing else. `find_model_family(name)` also accepts an alias (what `deepinfer make-model
--family` takes).

Where families come from, in look-up order (each source is imported only when a look-up needs it,
so importing the registry imports no model code):

1. the registered ones (`register_model_family`);
2. the in-tree ones (`BUILTIN_FAMILIES`): the first look-up of their `model_type` imports their
   `family` module, which registers them;
3. third-party ones: entry points of the group `deepinfer.model_families` (`MODEL_FAMILY_GROUP`),
   each NAMED after the `model_type` it provides, its value a module (`pkg.family`: importing it
   registers the family) or an object (`pkg.family:FAMILY`: a ModelFamily, registered here; or a
   callable, called, which registers one or returns it). The first look-up of an unknown type
   loads the entry points of that name; `supported_model_types()` lists every entry-point name
   without importing anything. A broken entry point is a `ModelFamilyPluginError` naming the entry
   point and its distribution, raised only by a look-up of its own type.

`load_model_family("module[:object]")` registers a family from such a reference directly (the
conformance kit's `--family-module`).

Writing random checkpoints (`CheckpointMaker`, optional): `deepinfer make-model OUT_DIR --family
NAME --size SIZE --seed N [--force] [family flags]` finds the family (`find_model_family`), adds
the family's own flags to its parser (`add_arguments(parser)`), and calls
`make(out_dir, size, seed, overwrite, **options)`, `options` being the parsed values of those flags
by argparse `dest`; `make` returns the one-line summary the command prints. `make` must give every
option a default, so that it can be called from Python without the parser.
"""
from __future__ import annotations

import argparse
import importlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any, NamedTuple

import torch

from deepinfer.models.common.config_values import Range, type_name
from deepinfer.models.common.errors import CheckpointError, ModelFamilyPluginError, UnknownModelTypeError
from deepinfer.models.common.safetensors_io import CONFIG_FILE, read_config
from deepinfer.models.protocol import (
    CONFIG_MEMBERS, MODEL_MEMBERS, Model, missing_members, missing_model_methods,
)

# model_type -> module whose import registers the in-tree family
BUILTIN_FAMILIES: dict[str, str] = {
    "deepseek_v4": "deepinfer.models.deepseek_v4.family",
    "deepseek_v41": "deepinfer.models.deepseek_v41.family",
}
#: entry-point group of third-party model families (entry-point name = the model_type)
MODEL_FAMILY_GROUP = "deepinfer.model_families"


@dataclass(frozen=True, eq=False)
class OpDefaults:
    """What a family asks of the ops it runs, unless told otherwise.

    `required_ops`: the ops its model calls: generic `Accelerator` kernels, or ops of the family's
    own op table; the builder checks the selected back end has every generic one before loading
    any weights (an op of `model_ops` is always there: the table has plain-torch defaults).
    `model_ops`: the family's op table class (its model-specific fused ops with plain-torch
    defaults; a back end may override them through `Accelerator.model_ops`), or None.
    `model_options`: keyword defaults handed to the model class (e.g. DeepSeek-V4's `query_block`,
    the prefill query-block size its attention kernels run over). `option_ranges`: the type and
    bounds of the numeric ones (`config_values.Range`), checked on every override: an option that
    sets work or a shape must be bounded, or `query_block = 0` runs and computes garbage."""

    required_ops: tuple[str, ...] = ()
    model_ops: type | None = None
    model_options: Mapping[str, Any] = field(default_factory=dict)
    option_ranges: Mapping[str, Range] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ops = tuple(self.required_ops)
        bad = [op for op in ops if not isinstance(op, str) or not op.isidentifier()]
        if bad:
            raise ValueError(f"required_ops must be accelerator method names; got {bad}")
        options = dict(self.model_options)
        bad = [k for k in options if not isinstance(k, str) or not k.isidentifier()]
        if bad:
            raise ValueError(f"model_options keys must be keyword names; got {bad}")
        if self.model_ops is not None and not isinstance(self.model_ops, type):
            raise ValueError(f"model_ops must be a class (the family's op table); got {self.model_ops!r}")
        ranges = dict(self.option_ranges)
        bad = sorted(k for k, r in ranges.items() if k not in options or not isinstance(r, Range))
        if bad:
            raise ValueError(f"option_ranges {bad} must be Ranges of declared model_options ({sorted(options)})")
        object.__setattr__(self, "required_ops", ops)
        object.__setattr__(self, "model_options", MappingProxyType(options))
        object.__setattr__(self, "option_ranges", MappingProxyType(ranges))

    def missing_ops(self, accelerator: object) -> list[str]:
        return [op for op in self.required_ops if not callable(getattr(accelerator, op, None))
                and not callable(getattr(self.model_ops, op, None))]


ParseConfig = Callable[[dict, str], Any]
LoadCheckpoint = Callable[[Path, "torch.dtype | str | None", dict], "tuple[Any, dict[str, torch.Tensor]]"]
#: make(out_dir, size, seed, overwrite, **options) -> the one-line summary of what was written
MakeCheckpoint = Callable[..., str]


@dataclass(frozen=True, eq=False)
class CheckpointMaker:
    """How `deepinfer make-model` writes a random-weight checkpoint of a family (module docstring).

    `make(out_dir, size, seed, overwrite, **options)`: writes the checkpoint folder and returns a
    one-line summary; a bad setting is a ValueError, a non-empty `out_dir` without `overwrite` a
    FileExistsError. `sizes`: the presets `--size` accepts, the first being the default.
    `add_arguments(parser)`: adds the family's own flags to the command's argparse parser; their
    parsed values reach `make` as `options`, by `dest`."""

    make: MakeCheckpoint
    sizes: tuple[str, ...]
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes)
        if not callable(self.make):
            raise ValueError(f"CheckpointMaker.make must be callable (got {self.make!r})")
        if not sizes or not all(isinstance(s, str) and s for s in sizes):
            raise ValueError(f"CheckpointMaker.sizes must be non-empty preset names (got {self.sizes!r})")
        if self.add_arguments is not None and not callable(self.add_arguments):
            raise ValueError(f"CheckpointMaker.add_arguments must be callable or None (got {self.add_arguments!r})")
        object.__setattr__(self, "sizes", sizes)


@dataclass(frozen=True, eq=False)
class ModelFamily:
    """One registry entry: parser, loader, model class and op defaults of a `model_type`."""

    model_type: str
    parse_config: ParseConfig
    load_checkpoint: LoadCheckpoint
    model_class: type
    op_defaults: OpDefaults = field(default_factory=OpDefaults)
    # transient forward memory for a step of that many tokens and sequences (bytes); None: a generic
    # estimate from hidden_size and vocab_size (see activation_reserve_bytes)
    activation_bytes: Callable[[Any, int, int], int] | None = None
    description: str = ""
    # random-weight checkpoints for `deepinfer make-model`; None: the family has none
    make_checkpoint: CheckpointMaker | None = None
    # other names `find_model_family` (make-model's --family) accepts, e.g. ("v4",)
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = []
        object.__setattr__(self, "aliases", tuple(self.aliases))
        if not all(isinstance(a, str) and a.strip() and a != self.model_type for a in self.aliases):
            problems.append(f"aliases must be non-empty names other than the model_type (got {self.aliases!r})")
        if self.make_checkpoint is not None and not isinstance(self.make_checkpoint, CheckpointMaker):
            problems.append(f"make_checkpoint must be a CheckpointMaker or None (got "
                            f"{type(self.make_checkpoint).__name__})")
        if not isinstance(self.model_type, str) or not self.model_type.strip():
            problems.append(f"model_type must be a non-empty string (got {self.model_type!r})")
        for name in ("parse_config", "load_checkpoint"):
            if not callable(getattr(self, name)):
                problems.append(f"{name} must be callable (got {getattr(self, name)!r})")
        if not isinstance(self.model_class, type):
            problems.append(f"model_class must be a class (got {self.model_class!r})")
        elif missing := missing_model_methods(self.model_class):
            problems.append(f"model_class {self.model_class.__name__} lacks the Model methods {missing} "
                            f"(deepinfer.models.protocol.Model)")
        if not isinstance(self.op_defaults, OpDefaults):
            problems.append(f"op_defaults must be an OpDefaults (got {type(self.op_defaults).__name__})")
        if self.activation_bytes is not None and not callable(self.activation_bytes):
            problems.append("activation_bytes must be callable or None")
        if problems:
            raise ValueError(f"invalid model family {self.model_type!r}: " + "; ".join(problems))

    @property
    def label(self) -> str:
        """The model_type and its aliases, for messages: `deepseek_v4 (alias v4)`."""
        return f"{self.model_type} (alias {', '.join(self.aliases)})" if self.aliases else self.model_type

    def check_accelerator(self, accelerator: object) -> None:
        """ValueError naming every kernel the family needs that the back end lacks."""
        missing = self.op_defaults.missing_ops(accelerator)
        if missing:
            name = getattr(accelerator, "name", type(accelerator).__name__)
            raise ValueError(f"model family {self.model_type!r} needs the accelerator kernels {missing}, which "
                             f"back end {name!r} does not provide; choose a back end that implements them "
                             f"(DEEPINFER_ACCELERATOR=cpu is the reference)")

    def model_options(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The keyword options the model class is built with: `op_defaults.model_options` updated
        with `overrides` (e.g. `EngineConfig.model_options`). ValueError for an option the family does
        not declare, naming it and the declared ones, and for a value outside its `option_ranges`."""
        declared = self.op_defaults.model_options
        unknown = sorted(set(overrides or {}) - set(declared))
        if unknown:
            known = ", ".join(sorted(declared)) or "none"
            raise ValueError(f"model_options {unknown} are not options of model family {self.model_type!r}; its "
                             f"options (OpDefaults.model_options) are: {known}. Remove or rename them")
        ranges = self.op_defaults.option_ranges
        problems = [p for k, v in (overrides or {}).items()
                    if k in ranges and (p := ranges[k].problem(f"model_options.{k}", v)) is not None]
        if problems:
            raise ValueError(f"invalid model_options of model family {self.model_type!r}: " + "; ".join(problems))
        return {**declared, **(overrides or {})}

    def build_model(self, config: Any, accelerator: object, dtype: torch.dtype, device: torch.device | str,
                    **options: Any) -> Model:
        """`model_class(config, accelerator, dtype=, device=, **self.model_options(options))`."""
        model = self.model_class(config, accelerator, dtype=dtype, device=device, **self.model_options(options))
        missing = missing_members(model, MODEL_MEMBERS) + missing_members(config, CONFIG_MEMBERS)
        if missing:
            raise TypeError(f"model family {self.model_type!r}: the model or its config lacks {missing}, which the "
                            f"engine reads (deepinfer.models.protocol.Model / ModelConfig)")
        return model

    def activation_reserve_bytes(self, config: Any, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        if self.activation_bytes is not None:
            return int(self.activation_bytes(config, max_num_batched_tokens, max_num_seqs))
        return activation_reserve_bytes(getattr(config, "hidden_size", 4096), getattr(config, "vocab_size", 0),
                                        max_num_batched_tokens, max_num_seqs)


def activation_reserve_bytes(residual_width: int, vocab_size: int, max_num_batched_tokens: int,
                             max_num_seqs: int) -> int:
    """A rough upper estimate of the forward's transient memory: the residual stream (`residual_width`
    values per token) and its temporaries for the step's tokens, plus the sampler's fp32 copies of the
    logits."""
    return max_num_batched_tokens * residual_width * 4 * 16 + max_num_seqs * vocab_size * 4 * 4


# --- the registry ------------------------------------------------------------------------------

_families: dict[str, ModelFamily] = {}
_lock = threading.RLock()


def register_model_family(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Add `family` under its `model_type`. Registering the same entry again is a no-op; another
    entry for a taken type is a ValueError unless `replace=True`, and so is an alias that another
    registered family uses as its type or alias."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_model_family takes a ModelFamily, got {type(family).__name__}")
    with _lock:
        current = _families.get(family.model_type)
        if current is not None and current is not family and not replace:
            raise ValueError(f"model_type {family.model_type!r} is already registered (model class "
                             f"{current.model_class.__name__}); pass replace=True to replace it")
        for other in _families.values():
            taken = sorted(set(family.aliases) & {other.model_type, *other.aliases})
            if other.model_type != family.model_type and taken:
                raise ValueError(f"model family {family.model_type!r}: the aliases {taken} already name model "
                                 f"family {other.model_type!r}; choose other aliases")
        _families[family.model_type] = family
    return family


def unregister_model_family(model_type: str) -> ModelFamily | None:
    """Remove and return the family of `model_type` (None if none is registered)."""
    with _lock:
        return _families.pop(model_type, None)


def supported_model_types() -> tuple[str, ...]:
    """Every model_type a checkpoint may name: the registered families, the in-tree ones and the
    `deepinfer.model_families` entry points (read from the installed metadata, not imported)."""
    with _lock:
        return tuple(sorted(set(_families) | set(BUILTIN_FAMILIES) | {ep.name for ep in _entry_points()}))


def _import_builtin(model_type: str) -> None:
    module = BUILTIN_FAMILIES.get(model_type)
    if module is not None and model_type not in _families:
        importlib.import_module(module)  # registers the family
        if model_type not in _families:
            raise RuntimeError(f"{module} did not register the model family {model_type!r}")


def _entry_points(name: str | None = None) -> list[metadata.EntryPoint]:
    """The group's entry points (those named `name`, if given); a distribution seen twice on
    sys.path (editable + site) counts once."""
    found: dict[tuple[str, str, str], metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=MODEL_FAMILY_GROUP):
        if name is None or ep.name == name:
            found.setdefault((ep.name, ep.value, _distribution(ep)), ep)
    return list(found.values())


def _distribution(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.metadata['Name']} {dist.version}" if dist is not None else "unknown"


def _describe(ep: metadata.EntryPoint) -> str:
    return f"entry point '{ep.name} = {ep.value}' (group {MODEL_FAMILY_GROUP}, distribution {_distribution(ep)})"


def register_family_object(obj: object) -> None:
    """Register what a `module[:object]` reference names: a module (importing it registered its
    family), a ModelFamily (registered here), or a callable (called: it registers a family, or
    returns one, which is registered here). TypeError for anything else."""
    if isinstance(obj, ModuleType):
        return
    if callable(obj):
        obj = obj()
        if obj is None:
            return
    if not isinstance(obj, ModelFamily):
        raise TypeError(f"expected a module, a ModelFamily or a callable that registers or returns one; got "
                        f"{type(obj).__name__}")
    register_model_family(obj)


def load_model_family(reference: str) -> None:
    """Import `module` or `module:object` (entry-point syntax) and register the family it names
    (`register_family_object`)."""
    register_family_object(metadata.EntryPoint(name=reference, value=reference, group=MODEL_FAMILY_GROUP).load())


def _load_entry_points(model_type: str) -> None:
    """Load the entry points named `model_type`: one of them must register that type."""
    eps = _entry_points(model_type)
    if len(eps) > 1:
        raise ModelFamilyPluginError(f"model_type {model_type!r} is provided by several entry points: "
                                     + "; ".join(_describe(ep) for ep in eps) + ". Uninstall all but one.")
    for ep in eps:
        try:
            register_family_object(ep.load())
        except Exception as exc:
            raise ModelFamilyPluginError(
                f"model family plugin {_describe(ep)} failed to load: {type(exc).__name__}: {exc}. Reinstall or "
                f"fix that package, or uninstall it (the other model families are not affected).") from exc
        if model_type not in _families:
            raise ModelFamilyPluginError(
                f"model family plugin {_describe(ep)} registered no family {model_type!r}: an entry point of "
                f"{MODEL_FAMILY_GROUP} must be named after the model_type its module or object registers.")


def get_model_family(model_type: object, source: str = CONFIG_FILE) -> ModelFamily:
    """The family of `model_type`; UnknownModelTypeError (a CheckpointError) listing the supported
    types for anything else, ModelFamilyPluginError if its entry point is broken."""
    with _lock:
        if isinstance(model_type, str):
            _import_builtin(model_type)
            if model_type not in _families:
                _load_entry_points(model_type)
            family = _families.get(model_type)
            if family is not None:
                return family
    missing = " (config.json must name the model's model_type)" if model_type is None else ""
    raise UnknownModelTypeError(f"{source}: model_type {model_type!r} is not supported{missing}; supported model "
                                f"types: {', '.join(supported_model_types())}")


def all_model_families(failures: dict[str, str] | None = None) -> list[ModelFamily]:
    """Every family, each source imported. A family that fails to import (a broken entry point or
    in-tree module) is left out, its model_type -> the error added to `failures` if given; a
    look-up of its own type raises that error."""
    with _lock:
        return list(_each_family({} if failures is None else failures))


def _each_family(failures: dict[str, str]) -> Iterator[ModelFamily]:
    """The registered families, then the in-tree ones, then the entry points', each imported when
    reached (so a search stops importing once it has found its family)."""
    yield from list(_families.values())
    pending = [t for t in BUILTIN_FAMILIES if t not in _families]
    pending += sorted({ep.name for ep in _entry_points()} - set(_families) - set(BUILTIN_FAMILIES))
    for model_type in pending:
        try:
            yield get_model_family(model_type)
        except Exception as exc:
            failures[model_type] = f"{type(exc).__name__}: {exc}"


def find_model_family(name: str) -> ModelFamily:
    """The family whose model_type or alias is `name`; UnknownModelTypeError listing every model_type
    and alias (and the families that failed to import) for anything else."""
    with _lock:
        if name in supported_model_types():
            return get_model_family(name)
        failures: dict[str, str] = {}
        for family in _each_family(failures):
            if name in family.aliases:
                return family
        choices = ", ".join(f.label for f in all_model_families(failures))
    broken = "".join(f"; {t} failed to import ({why})" for t, why in sorted(failures.items()))
    raise UnknownModelTypeError(f"unknown model family {name!r}; choose a model_type or alias: {choices}{broken}")


def family_for_config(config_dict: dict, source: str = CONFIG_FILE) -> ModelFamily:
    """The family a config.json dict names."""
    if not isinstance(config_dict, dict):
        raise CheckpointError(f"{source} must hold a JSON object with the model's settings (got "
                              f"{type_name(config_dict)})")
    return get_model_family(config_dict.get("model_type"), source)


class LoadedCheckpoint(NamedTuple):
    family: ModelFamily
    config: Any
    weights: dict[str, torch.Tensor]


def checkpoint_family(path: str | Path) -> tuple[ModelFamily, dict]:
    """(the family, the config.json dict) of the checkpoint folder `path`: config.json read once."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {root}")
    config_dict = read_config(root)
    return family_for_config(config_dict, str(root / CONFIG_FILE)), config_dict


def load_model_checkpoint(path: str | Path, dtype: torch.dtype | str | None = None) -> LoadedCheckpoint:
    """Read `path`'s config.json once, pick the family from its model_type and load the checkpoint
    with that family's loader: (family, parsed config, {canonical name: tensor})."""
    family, config_dict = checkpoint_family(path)
    config, weights = family.load_checkpoint(Path(path).expanduser(), dtype, config_dict)
    return LoadedCheckpoint(family, config, weights)
