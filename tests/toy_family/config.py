"""The toy family's config.json: parsed and range-checked with the shared config-value checks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.models.common.config_values import Range, range_problems, report, show_value
from deepinfer.models.common.errors import CheckpointError

MODEL_TYPE = "toy_dense"
FULL, SLIDING = "full_attention", "sliding_attention"

RANGES = {
    "vocab_size": Range(int, 2),
    "hidden_size": Range(int, 1),
    "num_heads": Range(int, 1),
    "head_dim": Range(int, 2),
    "intermediate_size": Range(int, 1),
    "sliding_window": Range(int, 1),
    "max_position_embeddings": Range(int, 1),
    "rope_theta": Range(float, 1, open_low=True),
    "rms_norm_eps": Range(float, 0),
}


@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int
    hidden_size: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[str, ...]  # FULL or SLIDING per layer
    kv_source: tuple[int | None, ...]  # per layer: None = own KV, j = read layer j's KV cache
    sliding_window: int = 8
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def owns_kv(self, layer: int) -> bool:
        return self.kv_source[layer] is None

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": MODEL_TYPE, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
                "layer_types": list(self.layer_types), "kv_source": list(self.kv_source),
                "sliding_window": self.sliding_window, "max_position_embeddings": self.max_position_embeddings,
                "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
                "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id}


def parse_config(d: dict, source: str = "config.json") -> ToyConfig:
    """ToyConfig from config.json; every problem listed in one CheckpointError."""
    if not isinstance(d, dict) or d.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{source}: not a {MODEL_TYPE} config")
    problems = range_problems(d, RANGES)
    missing = [k for k in ("vocab_size", "hidden_size", "num_heads", "head_dim", "intermediate_size",
                           "layer_types") if k not in d]
    problems += [f"{k} is missing" for k in missing]
    if isinstance(d.get("head_dim"), int) and d["head_dim"] % 2:
        problems.append(f"head_dim = {d['head_dim']} must be even (RoPE rotates pairs)")
    types = d.get("layer_types")
    if not isinstance(types, list) or not types or any(t not in (FULL, SLIDING) for t in types):
        problems.append(f"layer_types = {show_value(types)} must be a non-empty list of {FULL!r} / {SLIDING!r}")
        types = []
    source_of = d.get("kv_source", [None] * len(types))
    if not isinstance(source_of, list) or len(source_of) != len(types):
        problems.append(f"kv_source = {show_value(source_of)} must be a list with one entry per layer")
        source_of = [None] * len(types)
    for i, j in enumerate(source_of):
        if j is None:
            continue
        if not isinstance(j, int) or isinstance(j, bool) or not 0 <= j < i:
            problems.append(f"kv_source[{i}] = {show_value(j)} must be null or an earlier layer's index")
        elif types[i] != FULL or types[j] != FULL or source_of[j] is not None:
            problems.append(f"kv_source[{i}] = {j}: only a full-attention layer may read the KV of a full-attention "
                            f"layer that keeps its own")
    if problems:
        raise CheckpointError(report(source, problems))
    keys = {k: d[k] for k in ("vocab_size", "hidden_size", "num_heads", "head_dim", "intermediate_size",
                              "sliding_window", "max_position_embeddings", "rope_theta", "rms_norm_eps",
                              "bos_token_id", "eos_token_id") if k in d}
    return ToyConfig(layer_types=tuple(types), kv_source=tuple(source_of), **keys)
