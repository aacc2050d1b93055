"""What one token costs a model, counted from its parsed config (no weights needed).

Decode is bounded by the bytes it must read, prefill by the FLOPs it must do. What a token reads and
multiplies depends on the model family, so each family has its own module with three functions
(`FamilyCost`): `token_cost` (active weights of one decode token, by group), `cache_read_bytes`
(KV / compressed-cache bytes one decode token reads at a context) and `attention_flops` (attention
and indexer FLOPs of one query), plus its `cache_layout` (what the model stores per sequence):

- `cost_v4`: DeepSeek-V4 (`model_type: deepseek_v4`);
- `cost_v41`: DeepSeek-V4.1 (`model_type: deepseek_v41`).

`family_cost(config)` picks the module by the config's class (what the family's `parse_config`
returns); the functions below are the same for every family:

- a prefill token: 2 x the matrices one token multiplies + (2 x the head's, once per prompt, and the
  attention of every position) / prompt length;
- a decode step of B sequences reads the dense weights once, the routed experts the batch touches
  (expected number of distinct experts under uniform routing, E x (1 - (1 - k/E)^B) per layer) and
  B x (the per-sequence groups, e.g. the embedding row, + the cache it reads).
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.models.cache_layout import CacheLayout
# a pure function of any CacheLayout (block-group bytes per entry / tokens per entry), used for both families
from deepinfer.models.deepseek_v41.state import context_bytes_per_token as _layout_context_bytes

ROUTED_EXPERTS, EMBEDDING_ROW = "routed_experts", "embedding_row"
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.")  # a routed expert's tensor (layer, expert id)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def layer_group(name: str) -> str:
    """The cost group of a decoder-layer tensor, named alike in both DeepSeek families (a family
    sorts its own extras, e.g. Engram, before asking)."""
    if ".attn.compressor." in name or ".attn.indexer." in name:
        return "compressor_indexer"
    if ".attn." in name or name.endswith(".attn_norm.weight"):
        return "attention"
    if re.search(r"\.hc_(attn|ffn)_", name):
        return "mhc"
    if ".ffn.gate." in name:
        return "router"
    if ".ffn.shared_experts." in name or name.endswith(".ffn_norm.weight"):
        return "shared_expert"
    raise ValueError(f"the cost model does not know which group tensor {name!r} belongs to; add it to the "
                     f"family's _group (deepinfer/benchmarks/cost_*.py)")


@dataclass(frozen=True)
class TokenCost:
    """Per-token weight traffic and matmul work of one model (see the family modules)."""

    bytes_by_group: dict[str, int] = field(default_factory=dict)
    params_by_group: dict[str, int] = field(default_factory=dict)
    matmul_params: float = 0  # trunk weights one token multiplies (2 FLOPs each; < 1 share: once per entry)
    head_matmul_params: int = 0  # the head's matrices: only at positions whose logits are needed
    expert_bytes: int = 0  # one routed expert of one layer (w1 + w2 + w3)
    routed_layers: int = 0
    n_routed_experts: int = 0
    experts_per_tok: int = 0
    per_sequence_groups: tuple[str, ...] = ()  # groups every sequence of a batch reads for itself

    @property
    def active_bytes(self) -> int:
        return sum(self.bytes_by_group.values())

    @property
    def active_params(self) -> int:
        return sum(self.params_by_group.values())

    @property
    def sequence_bytes(self) -> int:
        """Weight bytes each sequence reads for itself (its embedding row, its Engram rows)."""
        return sum(self.bytes_by_group[g] for g in self.per_sequence_groups)

    @property
    def dense_bytes(self) -> int:
        """Bytes read once per step whatever the batch (everything but routed experts and the per-sequence groups)."""
        return self.active_bytes - self.bytes_by_group[ROUTED_EXPERTS] - self.sequence_bytes


def token_cost_from_shapes(config: Any, shapes: Mapping[str, tuple[int, ...]], groups: tuple[str, ...], *,
                           group: Callable[[str], str | None],
                           value_bytes: Callable[[str], int], matmul_share: Callable[[str, tuple[int, ...]], float],
                           per_sequence: Mapping[str, tuple[int, int]]) -> TokenCost:
    """Walk a family's `expected_weight_shapes`: each tensor goes to `group(name)` (None: not read
    per token) at `value_bytes(name)` per value; `matmul_share(name, shape)` is the share of tokens
    that multiply it (0 for a vector or an element-wise weight). Routed experts
    (`layers.{i}.ffn.experts.{e}.*`) count top-k per layer; `per_sequence`: group -> (bytes,
    params) each sequence reads for itself (the embedding row, ...)."""
    by_bytes = dict.fromkeys(groups, 0)
    by_params = dict.fromkeys(groups, 0)
    matmul = 0.0
    head_matmul = expert_bytes = expert_params = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        m = _EXPERT.match(name)
        if m:  # every routed expert has the same shapes: measure layer 0's expert 0, scale by k x layers
            if m.group(1) == "0" and m.group(2) == "0":
                expert_bytes += n * value_bytes(name)
                expert_params += n
            continue
        g = group(name)
        if g is None:
            continue
        by_bytes[g] += n * value_bytes(name)
        by_params[g] += n
        share = matmul_share(name, shape)
        if g == "head":
            head_matmul += int(share * n)
        else:
            matmul += share * n
    layers, k = config.num_hidden_layers, config.num_experts_per_tok
    by_bytes[ROUTED_EXPERTS] = expert_bytes * k * layers
    by_params[ROUTED_EXPERTS] = expert_params * k * layers
    matmul += expert_params * k * layers
    for g, (nbytes, params) in per_sequence.items():
        by_bytes[g], by_params[g] = nbytes, params
    return TokenCost(by_bytes, by_params, matmul, head_matmul, expert_bytes, layers, config.n_routed_experts, k,
                     tuple(per_sequence))


@dataclass(frozen=True)
class FamilyCost:
    """One family's counting functions (see the module docstring)."""

    model_type: str
    config_class: type
    token_cost: Callable[[Any, int], TokenCost]  # (config, float_bytes)
    cache_read_bytes: Callable[[Any, int, int], int]  # (config, context, float_bytes)
    attention_flops: Callable[[Any, int], int]  # (config, position)
    cache_layout: Callable[[Any, int], CacheLayout]  # (config, float_bytes), max_rollback 0


def _families() -> tuple[FamilyCost, ...]:
    from deepinfer.benchmarks import cost_v4, cost_v41  # they import this module's types

    return cost_v4.COST, cost_v41.COST


def family_cost(config: Any) -> FamilyCost:
    """The counting functions of the family whose parsed config `config` is."""
    families = _families()
    for cost in families:
        if isinstance(config, cost.config_class):
            return cost
    known = ", ".join(f"{c.model_type} ({c.config_class.__name__})" for c in families)
    raise ValueError(f"the benchmark's cost model does not know {type(config).__name__} configs; it counts {known}. "
                     f"Run without --roofline, or add a cost module for this family to deepinfer.benchmarks")


def checkpoint_config(path: str | Path) -> tuple[Any, dict, str]:
    """(parsed config, config.json as read, model_type) of the checkpoint folder `path`, parsed by
    the family its config.json names (no weights read)."""
    from deepinfer.models.registry import checkpoint_family

    family, raw = checkpoint_family(path)
    return family.parse_config(raw, str(Path(path) / "config.json")), raw, family.model_type


def token_cost(config: Any, float_bytes: int = 2) -> TokenCost:
    """Active weights of one decode token (batch 1, no speculation)."""
    return family_cost(config).token_cost(config, float_bytes)


def cache_bytes_per_token(config: Any, context: int, float_bytes: int = 2) -> int:
    """Cache bytes one decode token reads at `context` cached tokens (all layers)."""
    return family_cost(config).cache_read_bytes(config, context, float_bytes)


def attention_flops(config: Any, position: int) -> int:
    """Attention (and indexer) FLOPs of one query token at absolute `position`, all layers."""
    return family_cost(config).attention_flops(config, position)


def context_bytes_per_token(config: Any, float_bytes: int = 2) -> float:
    """Cache bytes the model stores per token of context (its block groups; the per-sequence rings
    and partial state are constant)."""
    return _layout_context_bytes(family_cost(config).cache_layout(config, float_bytes))


def expected_distinct_experts(n_experts: int, k: int, batch: int) -> float:
    """Expected number of distinct experts hit by `batch` tokens choosing k of n uniformly."""
    if batch <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - k / n_experts) ** batch)


def prefill_flops_per_token(config: Any, prompt_len: int, start: int = 0) -> float:
    """Mean FLOPs per token of prefilling positions [start, start + prompt_len) of one prompt
    (logits of the last position only)."""
    if prompt_len < 1:
        raise ValueError("prompt_len must be >= 1")
    cost = token_cost(config)
    attention = sum(attention_flops(config, t) for t in range(start, start + prompt_len))
    return 2 * cost.matmul_params + (2 * cost.head_matmul_params + attention) / prompt_len


def decode_step_bytes(config: Any, batch: int, context: int, float_bytes: int = 2) -> float:
    """Bytes one decode step of `batch` sequences at `context` tokens reads (weights + caches)."""
    cost = token_cost(config, float_bytes)
    experts = expected_distinct_experts(cost.n_routed_experts, cost.experts_per_tok, batch)
    return (cost.dense_bytes + experts * cost.expert_bytes * cost.routed_layers
            + batch * (cost.sequence_bytes + cache_bytes_per_token(config, context, float_bytes)))


def decode_step_flops(config: Any, batch: int, context: int) -> float:
    cost = token_cost(config)
    return batch * (2 * (cost.matmul_params + cost.head_matmul_params) + attention_flops(config, context))
