"""What the engine needs of a model: the `Model` protocol (and of its config: `ModelConfig`).

A model family's model class is built as `cls(config, accelerator, dtype=..., device=..., **options)`
(`options`: the family's op defaults, `registry.OpDefaults.model_options`) and then used only
through these members:

- `load_weights(weights)`: tensors under the family's canonical names, already dequantised (what
  the family's checkpoint loader returns);
- `cache_layout(max_rollback)`: the per-sequence state as a `CacheLayout` (owners and readers);
  rings sized so that the last `max_rollback` positions can be dropped exactly;
- `bind_cache(cache)`: the preallocated `CacheTensors` of that layout, bound once;
- `forward(batch)`: one ragged `ForwardBatch` (any mix of prefill chunks and decode tokens of many
  sequences) -> `ForwardOutput` (fp32 logits at `batch.logits_indices`);
- `drafter_heads()`: the model's own draft heads (e.g. DeepSeek-V4's MTP block), or None.

and the attributes `config` (a `ModelConfig`) and `device`.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from deepinfer.models.batch import ForwardBatch, ForwardOutput
from deepinfer.models.cache_layout import CacheLayout, CacheTensors


@runtime_checkable
class ModelConfig(Protocol):
    """The settings the engine reads from any family's parsed config."""

    vocab_size: int
    max_position_embeddings: int  # the longest sequence the model supports (max_model_len's limit)
    bos_token_id: int | None
    eos_token_id: int | list[int] | tuple[int, ...] | None


@runtime_checkable
class Model(Protocol):
    config: Any  # the family's parsed config (satisfies ModelConfig)
    device: torch.device

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load dequantised tensors under the family's canonical names (rebinds a bound cache)."""

    def cache_layout(self, max_rollback: int) -> CacheLayout:
        """The state one running sequence needs; rings keep `max_rollback` extra positions."""

    def bind_cache(self, cache: CacheTensors) -> None:
        """Bind the state preallocated from `cache_layout(...)` (checked against it)."""

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """One ragged step: writes the new tokens' state, returns logits at `batch.logits_indices`."""

    def drafter_heads(self) -> tuple[Any, ...] | None:
        """The model's draft heads (e.g. MTP blocks, in draft order), or None when it has none."""


MODEL_MEMBERS = ("config", "device")
MODEL_METHODS = ("load_weights", "cache_layout", "bind_cache", "forward", "drafter_heads")
CONFIG_MEMBERS = ("vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id")


def missing_model_methods(cls: type) -> list[str]:
    """The `Model` methods a class does not define (callable attributes), in protocol order."""
    return [m for m in MODEL_METHODS if not callable(getattr(cls, m, None))]


def missing_members(obj: object, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if not hasattr(obj, n)]


def drafter_heads(model: object) -> tuple[Any, ...] | None:
    """`model.drafter_heads()`, or None for a model that has no such method."""
    method = getattr(model, "drafter_heads", None)
    return method() if callable(method) else None
