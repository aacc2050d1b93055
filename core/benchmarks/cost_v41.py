"""What one token costs a DeepSeek-V4.1 model (`model_type: deepseek_v41`), counted from its config.

Every number comes from the parsed `DeepseekV41Config`: the tensors from `weights.expected_weight_shapes`,
the layer roles (`config.layer_roles`, `kv_owner`, `topk_owner`, `uses_candidates`) and the cache
entry sizes from the model's own cache layout (`state.build_cache_layout`).

Active weights of one decode token (batch 1, no speculation: the DSpark head is not in the
backbone's tensors): every backbone tensor except that only `num_experts_per_tok` routed experts
per layer count, the embedding counts one row, the router's `gate.bias_vl` (image tokens only) is
left out, and the Engram tables count the rows one token gathers. Groups: attention (wq_a, wq_b,
wkv, wo_a, wo_b, norms, sinks: every layer), compressor + indexer (only the roles that own them:
a Full layer, i.e. a KV source, its compressor and indexer; a Reindex layer its indexer query;
Reuse and sliding layers none), Engram (`wkv`, `q_weight`, `k_weight`), mHC (hc_attn_*, hc_ffn_*:
single-pass, no hc_head), router, shared expert (+ ffn norm), routed experts (top-k), head (final
norm, head), embedding row, Engram rows (per Engram layer `(max_ngram - 1) x n_heads` table rows of
`engram_head_dim` FP8 codes + one ue8m0 scale per 32, one byte each: 24 x 264 B in the release).
Bytes: tensors the model keeps in fp32 (mHC, sinks, router weight and bias, the compressor's wkv and
wgate) count 4 bytes per value, the rest `float_bytes`.

Cache bytes one decode token reads at context T (fixed formats, whatever the model dtype): every
layer its FP8 window (min(T, window) keys of 512 + 16 bytes in the release); a compressed layer of
ratio r the min(index_topk, scored) compressed entries its top-k owner selected, read from its KV
source (NVFP4, 288 B); an index source (Full, Reindex) the index keys it scores (MXFP4, 68 B):
all floor(T/r) visible ones, or, after the candidate source, only its candidate pool
(`candidate_topk_blocks` blocks of `candidate_block_size` entries, the newest block always kept).
A Reuse layer scores nothing and reads the same selected entries as its owner. The compressor's
pending rows and the n-gram history are constant and ignored.

FLOPs of one token at position t: 2 x (the matrices it multiplies: every active 2-D weight but the
embedding, the Engram tables and the element-wise `q_weight` / `k_weight`; a Full layer's index-key
projection `indexer.wk` runs once per compressed entry, so 1/r per token; in prefill the head runs
once per prompt) + attention 4 x H x head_dim per key (window + selected entries) + indexer
2 x index_n_heads x (index_head_dim + 1) per scored entry. Element-wise work (norms, RoPE, softmax,
pooling, Sinkhorn, SwiGLU, quantisation, the Engram gate) is not counted.
"""
from __future__ import annotations

import re

from deepinfer.benchmarks.model_cost import (
    EMBEDDING_ROW, ROUTED_EXPERTS, FamilyCost, TokenCost, layer_group, token_cost_from_shapes,
)
from deepinfer.models.cache_layout import CacheLayout
from deepinfer.models.deepseek_v41.config import FULL, REINDEX, DeepseekV41Config
from deepinfer.models.deepseek_v41.model import _FP32_SUFFIXES as MODEL_FP32_SUFFIXES
from deepinfer.models.deepseek_v41.state import COMPRESSED_KV, INDEX_KEYS, WINDOW_KV, build_cache_layout, group_name
from deepinfer.models.deepseek_v41.weights import expected_weight_shapes, weight_kind

ENGRAM_ROWS = "engram_rows"
GROUPS = ("attention", "compressor_indexer", "engram", "mhc", "router", "shared_expert", ROUTED_EXPERTS, "head",
          EMBEDDING_ROW, ENGRAM_ROWS)
STORED_BYTES = 1  # an Engram table value: an FP8 e4m3 code or a ue8m0 scale (kept as stored)
_LAYER = re.compile(r"^layers\.(\d+)\.")


def _group(name: str) -> str | None:
    """Which cost group a (non-expert) tensor belongs to; None: not read per text token."""
    if name == "embed.weight" or ".engram.embed." in name or name.endswith("ffn.gate.bias_vl"):
        return None  # one embedding row and the gathered Engram rows are counted per sequence
    if name in ("head.weight", "norm.weight"):
        return "head"
    if ".engram." in name:
        return "engram"
    return layer_group(name)


def _matmul_share(config: DeepseekV41Config, name: str, shape: tuple[int, ...]) -> float:
    if len(shape) != 2 or name.endswith((".engram.q_weight", ".engram.k_weight")):
        return 0.0  # vectors, and the Engram gate's element-wise weights
    if ".attn.indexer.wk." in name:  # the index key of each completed group of r tokens
        return 1.0 / config.compress_ratio(int(_LAYER.match(name).group(1)))
    return 1.0


def token_cost(config: DeepseekV41Config, float_bytes: int = 2) -> TokenCost:
    """Active weights of one decode token (batch 1)."""
    shapes = expected_weight_shapes(config)
    rows_bytes = rows_params = 0
    for layer in config.engram_layer_ids:  # the rows one token gathers from each Engram table
        _, hd = shapes[f"layers.{layer}.engram.embed.weight"]
        _, scales = shapes[f"layers.{layer}.engram.embed.scale"]
        rows_bytes += config.engram_hash_heads * (hd + scales) * STORED_BYTES
        rows_params += config.engram_hash_heads * hd
    D = config.hidden_size

    def value_bytes(name: str) -> int:
        return 4 if weight_kind(name) == "fp32" or name.endswith(MODEL_FP32_SUFFIXES) else float_bytes

    return token_cost_from_shapes(
        config, shapes, GROUPS, group=_group, value_bytes=value_bytes,
        matmul_share=lambda name, shape: _matmul_share(config, name, shape),
        per_sequence={EMBEDDING_ROW: (D * float_bytes, D), ENGRAM_ROWS: (rows_bytes, rows_params)})


def scored_entries(config: DeepseekV41Config, layer: int, entries: int) -> int:
    """Compressed entries index source `layer` scores when `entries` are visible: all of them, or
    after the candidate source only its candidate pool (the newest block always kept)."""
    if not config.uses_candidates(layer):
        return entries
    size, keep = config.candidate_block_size, config.candidate_topk_blocks
    blocks = -(-entries // size)
    if blocks <= keep:
        return entries
    return (keep - 1) * size + entries - (blocks - 1) * size  # keep - 1 full blocks + the newest


def _layer_reads(config: DeepseekV41Config, layer: int, visible: int) -> tuple[int, int, int]:
    """(window keys, selected compressed entries, scored index keys) of `layer` for a query that
    sees `visible` tokens (in prefill its position + 1; in decode the cached context)."""
    window = min(visible, config.sliding_window)
    r = config.compress_ratio(layer)
    if not r:
        return window, 0, 0
    entries = visible // r
    selected = min(config.index_topk, scored_entries(config, config.topk_owner[layer], entries))
    scored = scored_entries(config, layer, entries) if config.layer_roles[layer] in (FULL, REINDEX) else 0
    return window, selected, scored


def cache_layout(config: DeepseekV41Config, float_bytes: int = 2) -> CacheLayout:
    """The model's own cache layout (its formats are fixed: `float_bytes` does not change them)."""
    return build_cache_layout(config, max_rollback=0)


def cache_read_bytes(config: DeepseekV41Config, context: int, float_bytes: int = 2) -> int:
    """Cache bytes one decode token reads at `context` cached tokens, all layers (module docstring)."""
    layout = cache_layout(config)
    window = layout.slot_tensor(WINDOW_KV)
    key_bytes = window.bytes_per_copy() // window.shape[0]
    total = 0
    for layer in range(config.num_hidden_layers):
        keys, selected, scored = _layer_reads(config, layer, context)
        total += keys * key_bytes
        if selected or scored:
            group = layout.group(group_name(config.compress_ratio(layer)))
            total += (selected * group.tensor(COMPRESSED_KV).bytes_per_copy()
                      + scored * group.tensor(INDEX_KEYS).bytes_per_copy())
    return total


def attention_flops(config: DeepseekV41Config, position: int) -> int:
    """Attention and indexer FLOPs of one query token at absolute `position`, all layers."""
    per_key = 4 * config.num_attention_heads * config.head_dim
    per_scored = 2 * config.index_n_heads * (config.index_head_dim + 1)
    flops = 0
    for layer in range(config.num_hidden_layers):
        keys, selected, scored = _layer_reads(config, layer, position + 1)
        flops += per_key * (keys + selected) + per_scored * scored
    return flops


COST = FamilyCost(model_type="deepseek_v41", config_class=DeepseekV41Config, token_cost=token_cost,
                  cache_read_bytes=cache_read_bytes, attention_flops=attention_flops, cache_layout=cache_layout)
