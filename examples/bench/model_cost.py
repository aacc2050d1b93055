"""What one token costs a DeepSeek-V4 model, counted from its config (no weights needed).

Decode is bounded by the bytes it must read, prefill by the FLOPs it must do. Counted here:

Active weights of one token (batch 1, no speculation, so the MTP block is excluded):
  every tensor of `expected_weight_shapes` except that only `num_experts_per_tok` routed experts
  per layer count, the embedding counts one row, and the hash-routing table `tid2eid` is left
  out (one row of k integers). Groups: attention (wq_a, wq_b, wkv, wo_a, wo_b, norms, sinks),
  compressor + indexer (CSA/HCA layers), mHC (hc_attn_*, hc_ffn_*), router (gate weight and bias),
  shared expert (+ ffn norm), routed experts (top-k), head (final norm, hc_head_*, head), embedding
  row. Bytes: tensors the model keeps in fp32 (`weight_kind` == "fp32": mHC, router, norms, sinks,
  position biases) count 4 bytes per value, the rest `float_bytes` (2 for bf16).

KV/compressed-cache bytes one decode token reads at context T, per layer (`cache_bytes` per value):
  sliding: min(T, window) x head_dim; HCA: window + floor(T/m_hca) x head_dim;
  CSA: window + min(index_topk, floor(T/m_csa)) x head_dim (selected entries)
       + floor(T/m_csa) x index_head_dim (every indexer key is scored).
  Compressor partial state and the sliding ring's bookkeeping are constant and ignored.

FLOPs of one token at position t: 2 x (matrix weights it multiplies: every active 2-D weight but
  the embedding, fp32 ones included; in prefill the head and hc_head run once per prompt, for the
  last position only) + attention 4 x H x head_dim per key (scores and values) +
  indexer 2 x index_n_heads x (index_head_dim + 1) per scored entry. Element-wise work (norms,
  RoPE, softmax, pooling, Sinkhorn, SwiGLU) is not counted.

A decode step of B sequences reads the dense weights once, the routed experts the batch touches
(expected number of distinct experts under uniform routing, E x (1 - (1 - k/E)^B) per layer) and
B x (cache + embedding row).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from deepinfer.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config
from deepinfer.models.deepseek_v4.weights import expected_weight_shapes, weight_kind

GROUPS = ("attention", "compressor_indexer", "mhc", "router", "shared_expert", "routed_experts", "head",
          "embedding_row")
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def _group(name: str) -> str | None:
    """Which cost group a (non-MTP, non-expert) tensor belongs to; None: not read per token."""
    if name == "embed.weight" or name.endswith("ffn.gate.tid2eid"):
        return None
    if name in ("head.weight", "norm.weight") or name.startswith("hc_head"):
        return "head"
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
    raise ValueError(f"model_cost does not know which group tensor {name!r} belongs to; add it to _group")


@dataclass(frozen=True)
class TokenCost:
    """Per-token weight traffic and matmul work of one model (see the module docstring)."""

    bytes_by_group: dict[str, int] = field(default_factory=dict)
    params_by_group: dict[str, int] = field(default_factory=dict)
    matmul_params: int = 0  # trunk weights one token multiplies (2 FLOPs each)
    head_matmul_params: int = 0  # hc_head_fn + head: only at positions whose logits are needed
    expert_bytes: int = 0  # one routed expert of one layer (w1 + w2 + w3)
    routed_layers: int = 0
    n_routed_experts: int = 0
    experts_per_tok: int = 0

    @property
    def active_bytes(self) -> int:
        return sum(self.bytes_by_group.values())

    @property
    def active_params(self) -> int:
        return sum(self.params_by_group.values())

    @property
    def dense_bytes(self) -> int:
        """Bytes read once per step whatever the batch (everything but routed experts and the embedding row)."""
        return self.active_bytes - self.bytes_by_group["routed_experts"] - self.bytes_by_group["embedding_row"]


def token_cost(config: DeepseekV4Config, float_bytes: int = 2) -> TokenCost:
    """Active weights of one decode token (batch 1, MTP excluded)."""
    by_bytes = dict.fromkeys(GROUPS, 0)
    by_params = dict.fromkeys(GROUPS, 0)
    matmul = head_matmul = 0
    expert_bytes = expert_params = 0
    for name, shape in expected_weight_shapes(config, include_mtp=False).items():
        n = math.prod(shape)
        size = 4 if weight_kind(name) == "fp32" else float_bytes
        m = _EXPERT.match(name)
        if m:  # every routed expert has the same shapes: measure layer 0's expert 0, scale by k x layers
            if m.group(1) == "0" and m.group(2) == "0":
                expert_bytes += n * size
                expert_params += n
            continue
        group = _group(name)
        if group is None:
            continue
        by_bytes[group] += n * size
        by_params[group] += n
        is_matrix = len(shape) == 2 and not name.endswith(".ape")  # ape is an additive position bias
        if is_matrix and group == "head":
            head_matmul += n
        elif is_matrix:
            matmul += n
    layers = config.num_hidden_layers
    k = config.num_experts_per_tok
    by_bytes["routed_experts"] = expert_bytes * k * layers
    by_params["routed_experts"] = expert_params * k * layers
    matmul += expert_params * k * layers
    by_bytes["embedding_row"] = config.hidden_size * float_bytes
    by_params["embedding_row"] = config.hidden_size
    return TokenCost(by_bytes, by_params, matmul, head_matmul, expert_bytes, layers, config.n_routed_experts, k)


def expected_distinct_experts(n_experts: int, k: int, batch: int) -> float:
    """Expected number of distinct experts hit by `batch` tokens choosing k of n uniformly."""
    if batch <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - k / n_experts) ** batch)


def cache_bytes_per_token(config: DeepseekV4Config, context: int, cache_bytes: int = 2) -> int:
    """KV / compressed-cache bytes one decode token reads at `context` cached tokens (all layers)."""
    d, W = config.head_dim, config.sliding_window
    total = 0
    for layer_type in config.layer_types:
        values = min(context, W) * d
        if layer_type == CSA:
            entries = context // config.csa_compress_rate
            values += min(config.index_topk, entries) * d + entries * config.index_head_dim
        elif layer_type == HCA:
            values += (context // config.hca_compress_rate) * d
        total += values * cache_bytes
    return total


def attention_flops(config: DeepseekV4Config, position: int) -> int:
    """Attention (and indexer) FLOPs of one query token at absolute `position`, all layers."""
    H, d, W = config.num_attention_heads, config.head_dim, config.sliding_window
    t1 = position + 1  # tokens visible to the query, itself included
    flops = 0
    for layer_type in config.layer_types:
        keys = min(t1, W)
        if layer_type == CSA:
            entries = t1 // config.csa_compress_rate
            keys += min(config.index_topk, entries)
            flops += 2 * config.index_n_heads * (config.index_head_dim + 1) * entries
        elif layer_type == HCA:
            keys += t1 // config.hca_compress_rate
        flops += 4 * H * d * keys
    return flops


def prefill_flops_per_token(config: DeepseekV4Config, prompt_len: int, start: int = 0) -> float:
    """Mean FLOPs per token of prefilling positions [start, start + prompt_len) of one prompt
    (logits of the last position only)."""
    if prompt_len < 1:
        raise ValueError("prompt_len must be >= 1")
    cost = token_cost(config)
    attention = sum(attention_flops(config, t) for t in range(start, start + prompt_len))
    return 2 * cost.matmul_params + (2 * cost.head_matmul_params + attention) / prompt_len


def decode_step_bytes(config: DeepseekV4Config, batch: int, context: int, float_bytes: int = 2,
                      cache_bytes: int = 2) -> float:
    """Bytes one decode step of `batch` sequences at `context` tokens reads (weights + caches)."""
    cost = token_cost(config, float_bytes)
    experts = expected_distinct_experts(cost.n_routed_experts, cost.experts_per_tok, batch)
    return (cost.dense_bytes + experts * cost.expert_bytes * cost.routed_layers
            + batch * (cost.bytes_by_group["embedding_row"] + cache_bytes_per_token(config, context, cache_bytes)))


def decode_step_flops(config: DeepseekV4Config, batch: int, context: int) -> float:
    cost = token_cost(config)
    return batch * (2 * (cost.matmul_params + cost.head_matmul_params) + attention_flops(config, context))
