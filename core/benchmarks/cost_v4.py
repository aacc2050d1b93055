"""What one token costs a DeepSeek-V4 model (`model_type: deepseek_v4`), counted from its config.

Active weights of one token (batch 1, no speculation, so the MTP block is excluded):
  every tensor of `expected_weight_shapes` except that only `num_experts_per_tok` routed experts
  per layer count, the embedding counts one row, and the hash-routing table `tid2eid` is left
  out (one row of k integers). Groups: attention (wq_a, wq_b, wkv, wo_a, wo_b, norms, sinks),
  compressor + indexer (CSA/HCA layers), mHC (hc_attn_*, hc_ffn_*), router (gate weight and bias),
  shared expert (+ ffn norm), routed experts (top-k), head (final norm, hc_head_*, head), embedding
  row. Bytes: tensors the model keeps in fp32 (`weight_kind` == "fp32": mHC, router, norms, sinks,
  position biases) count 4 bytes per value, the rest `float_bytes` (2 for bf16).

KV/compressed-cache bytes one decode token reads at context T, per layer (the caches are kept in
the model dtype, `float_bytes` per value):
  sliding: min(T, window) x head_dim; HCA: window + floor(T/m_hca) x head_dim;
  CSA: window + min(index_topk, floor(T/m_csa)) x head_dim (selected entries)
       + floor(T/m_csa) x index_head_dim (every indexer key is scored).
  Compressor partial state and the sliding ring's bookkeeping are constant and ignored.

FLOPs of one token at position t: 2 x (matrix weights it multiplies: every active 2-D weight but
  the embedding, fp32 ones included; in prefill the head and hc_head run once per prompt, for the
  last position only) + attention 4 x H x head_dim per key (scores and values) +
  indexer 2 x index_n_heads x (index_head_dim + 1) per scored entry. Element-wise work (norms,
  RoPE, softmax, pooling, Sinkhorn, SwiGLU) is not counted.
"""
from __future__ import annotations

import torch

from deepinfer.benchmarks.model_cost import (
    EMBEDDING_ROW, ROUTED_EXPERTS, FamilyCost, TokenCost, layer_group, token_cost_from_shapes,
)
from deepinfer.models.cache_layout import CacheLayout
from deepinfer.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config
from deepinfer.models.deepseek_v4.state import build_cache_layout
from deepinfer.models.deepseek_v4.weights import expected_weight_shapes, weight_kind

GROUPS = ("attention", "compressor_indexer", "mhc", "router", "shared_expert", ROUTED_EXPERTS, "head", EMBEDDING_ROW)


def _group(name: str) -> str | None:
    """Which cost group a (non-MTP, non-expert) tensor belongs to; None: not read per token."""
    if name == "embed.weight" or name.endswith("ffn.gate.tid2eid"):
        return None
    if name in ("head.weight", "norm.weight") or name.startswith("hc_head"):
        return "head"
    return layer_group(name)


def token_cost(config: DeepseekV4Config, float_bytes: int = 2) -> TokenCost:
    """Active weights of one decode token (batch 1, MTP excluded)."""
    D = config.hidden_size
    return token_cost_from_shapes(
        config, expected_weight_shapes(config, include_mtp=False), GROUPS, group=_group,
        value_bytes=lambda name: 4 if weight_kind(name) == "fp32" else float_bytes,
        # every 2-D weight is multiplied by every token, but `ape`, an additive position bias
        matmul_share=lambda name, shape: float(len(shape) == 2 and not name.endswith(".ape")),
        per_sequence={EMBEDDING_ROW: (D * float_bytes, D)})


def cache_read_bytes(config: DeepseekV4Config, context: int, float_bytes: int = 2) -> int:
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
        total += values * float_bytes
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


def cache_layout(config: DeepseekV4Config, float_bytes: int = 2) -> CacheLayout:
    """The model's own cache layout (caches in the model dtype, of `float_bytes` per value)."""
    return build_cache_layout(config, torch.float32 if float_bytes == 4 else torch.bfloat16, max_rollback=0)


COST = FamilyCost(model_type="deepseek_v4", config_class=DeepseekV4Config, token_cost=token_cost,
                  cache_read_bytes=cache_read_bytes, attention_flops=attention_flops, cache_layout=cache_layout)
