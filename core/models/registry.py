"""Model families, keyed by config.json's `model_type`.

A family is what the engine needs to serve one kind of checkpoint:

    ModelFamily(model_type="deepseek_v4",
                parse_config=parse_config,          # (config.json dict, source) -> config
                load_checkpoint=load_checkpoint,    # (folder, dtype, config.json dict) -> (config, {name: tensor})
                model_class=DeepseekV4ForCausalLM,  # cls(config, accelerator, dtype=, device=, **options): a Model
                op_defaults=OpDefaults(required_ops=(...), model_options={"query_block": 256}))

`register_model_family(family)` adds one; `get_model_family(model_type)` finds one, and an unknown
type is an `UnknownModelTypeError` (a CheckpointError) listing the supported types.
`checkpoint_family(path)` reads config.json once and picks the family from its `model_type`;
`load_model_checkpoint(path, dtype)` then runs that family's loader. The engine builder uses
nothing else.

The in-tree families are registered lazily: the first look-up of their `model_type` imports their
`family` module (`BUILTIN_FAMILIES`), so importing the registry imports no model code.
"""
from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from deepinfer.models.common.config_values import type_name
from deepinfer.models.common.errors import CheckpointError, UnknownModelTypeError
from deepinfer.models.common.safetensors_io import CONFIG_FILE, read_config
from deepinfer.models.protocol import (
    CONFIG_MEMBERS, MODEL_MEMBERS, Model, missing_members, missing_model_methods,
)

# model_type -> module whose import registers the in-tree family
BUILTIN_FAMILIES: dict[str, str] = {
    "deepseek_v4": "deepinfer.models.deepseek_v4.family",
}


@dataclass(frozen=True, eq=False)
class OpDefaults:
    """What a family asks of the ops it runs, unless told otherwise.

    `required_ops`: the ops its model calls: generic `Accelerator` kernels, or ops of the family's
    own op table; the builder checks the selected back end has every generic one before loading
    any weights (an op of `model_ops` is always there: the table has plain-torch defaults).
    `model_ops`: the family's op table class (its model-specific fused ops with plain-torch
    defaults; a back end may override them through `Accelerator.model_ops`), or None.
    `model_options`: keyword defaults handed to the model class (e.g. DeepSeek-V4's `query_block`,
    the prefill query-block size its attention kernels run over)."""

    required_ops: tuple[str, ...] = ()
    model_ops: type | None = None
    model_options: Mapping[str, Any] = field(default_factory=dict)

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
        object.__setattr__(self, "required_ops", ops)
        object.__setattr__(self, "model_options", MappingProxyType(options))

    def missing_ops(self, accelerator: object) -> list[str]:
        return [op for op in self.required_ops if not callable(getattr(accelerator, op, None))
                and not callable(getattr(self.model_ops, op, None))]


ParseConfig = Callable[[dict, str], Any]
LoadCheckpoint = Callable[[Path, "torch.dtype | str | None", dict], "tuple[Any, dict[str, torch.Tensor]]"]


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

    def __post_init__(self) -> None:
        problems = []
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

    def check_accelerator(self, accelerator: object) -> None:
        """ValueError naming every kernel the family needs that the back end lacks."""
        missing = self.op_defaults.missing_ops(accelerator)
        if missing:
            name = getattr(accelerator, "name", type(accelerator).__name__)
            raise ValueError(f"model family {self.model_type!r} needs the accelerator kernels {missing}, which "
                             f"back end {name!r} does not provide; choose a back end that implements them "
                             f"(DEEPINFER_ACCELERATOR=cpu is the reference)")

    def build_model(self, config: Any, accelerator: object, dtype: torch.dtype, device: torch.device | str,
                    **options: Any) -> Model:
        """`model_class(config, accelerator, dtype=, device=, **op_defaults.model_options | options)`."""
        model = self.model_class(config, accelerator, dtype=dtype, device=device,
                                 **{**self.op_defaults.model_options, **options})
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
    entry for a taken type is a ValueError unless `replace=True`."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_model_family takes a ModelFamily, got {type(family).__name__}")
    with _lock:
        current = _families.get(family.model_type)
        if current is not None and current is not family and not replace:
            raise ValueError(f"model_type {family.model_type!r} is already registered (model class "
                             f"{current.model_class.__name__}); pass replace=True to replace it")
        _families[family.model_type] = family
    return family


def unregister_model_family(model_type: str) -> ModelFamily | None:
    """Remove and return the family of `model_type` (None if none is registered)."""
    with _lock:
        return _families.pop(model_type, None)


def supported_model_types() -> tuple[str, ...]:
    """Every model_type a checkpoint may name: the registered families and the in-tree ones."""
    with _lock:
        return tuple(sorted(set(_families) | set(BUILTIN_FAMILIES)))


def _import_builtin(model_type: str) -> None:
    module = BUILTIN_FAMILIES.get(model_type)
    if module is not None and model_type not in _families:
        importlib.import_module(module)  # registers the family
        if model_type not in _families:
            raise RuntimeError(f"{module} did not register the model family {model_type!r}")


def get_model_family(model_type: object, source: str = CONFIG_FILE) -> ModelFamily:
    """The family of `model_type`; UnknownModelTypeError (a CheckpointError) listing the supported
    types for anything else."""
    with _lock:
        if isinstance(model_type, str):
            _import_builtin(model_type)
            family = _families.get(model_type)
            if family is not None:
                return family
    missing = " (config.json must name the model's model_type)" if model_type is None else ""
    raise UnknownModelTypeError(f"{source}: model_type {model_type!r} is not supported{missing}; supported model "
                                f"types: {', '.join(supported_model_types())}")


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
