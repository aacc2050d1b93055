"""DeepSeek-V4.1 tensor naming: the official (release) names are canonical, without prefix.

- `expected_weight_shapes(config)`: every tensor the backbone needs, with its logical (dequantised)
  shape; the Engram tables `layers.{i}.engram.embed.weight` / `.scale` stay as stored, so their
  entries are the stored shapes (FP8 `[rows, engram_head_dim]`, one ue8m0 scale per 32 channels).
- `weight_kind(name)`: "fp32" (mHC `hc_*`, `attn_sink`, router `gate.bias` / `gate.bias_vl`),
  "quantized" (an Engram table or its scale: kept as stored) or "float" (the model dtype).
- `is_quantizable(name)`: the weights the model reads only through linear / grouped_linear /
  moe_experts, which may stay quantised for a back end that declares their format.
- `canonicalize(state)`: official names, the same with a `model.` prefix, transformers' scale
  spelling (`<w>.weight_scale_inv`) and NeMo AutoModel's native names (`model.embed_tokens.weight`,
  `lm_head.weight`, `model.layers.{i}.attn_hc.fn`, `attn.sinks_param.weight`,
  `ffn.gate.e_score_correction_bias`, `gate_proj` / `up_proj` / `down_proj` for w1 / w3 / w2, and the
  grouped experts `ffn.experts.gate_and_up_projs [E, D, 2I]` / `down_projs [E, I, D]`, split per
  expert) -> official names. Unknown names pass through with `model.` dropped, so that the loader
  reports them.
- `is_skipped(name)`: tensors the backbone loader leaves out (`SKIPPED_PREFIXES`: the DSpark drafter
  `mtp.*` unless the config has DSpark stages, the vision tower `vision.*` / `aligner.*` and the image
  delimiters unless the config has a vision tower and the checkpoint holds it; their shapes:
  `vision.vision_weight_shapes`).
- `dspark_weight_shapes(config)`: the DSpark drafter's tensors (`mtp.{0..S-1}.*`), loaded with the
  backbone when `num_nextn_predict_layers` > 0 and the checkpoint holds them.

Which tensors a layer owns follows its role (`config.layer_roles`): a Full layer (KV source) owns the
compressor (`wgate` only when its compress ratio is above 1) and the indexer with its key projection
(`wk`, `k_norm`); a Reindex layer only the indexer's query side (`wq_b`, `weights_proj`); Reuse and
sliding layers neither.
"""
from __future__ import annotations

import re

import torch

from deepinfer.models.common.weights import (
    CanonicalNames, canonicalize_blocks, drop_prefix, hf_scale_to_official, rename_prefix,
)
from deepinfer.models.deepseek_v41.config import FULL, REINDEX, SLIDING, DeepseekV41Config
from deepinfer.models.deepseek_v41.vision import VISION_PREFIXES

ENGRAM_GROUP = 32  # channels per ue8m0 scale of an Engram table row
DSPARK_PREFIX = "mtp."
SKIPPED_PREFIXES = (DSPARK_PREFIX,) + VISION_PREFIXES

# read only through linear / grouped_linear / moe_experts; not the compressor's (kept in fp32 by the
# model), the router, norms, the embedding or the Engram tables
_QUANTIZABLE_RE = re.compile(
    r"^(head|layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.(wq_b|weights_proj|wk))"
    r"|ffn\.(shared_experts|experts\.\d+)\.w[123]|engram\.wkv))\.weight$")
_FP32_RE = re.compile(r"(^|\.)(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink|ffn\.gate\.bias|ffn\.gate\.bias_vl"
                      r"|confidence_head\.proj\.weight)$|^vision\.(blocks\.\d+\.norm[12]|norm)\.weight$")
_ENGRAM_TABLE_RE = re.compile(r"^layers\.\d+\.engram\.embed\.(weight|scale)$")
_BLOCK_RE = re.compile(r"^(layers\.\d+)\.(.+)$")
_GROUPED_RE = re.compile(r"^ffn\.experts\.(gate_and_up_projs|down_projs)$")
_NATIVE_TOP = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight"}
# NeMo-native in-layer spellings -> official (prefix renames; per-expert w1/w2/w3 handled below)
_NATIVE_LAYER = (
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("attn.sinks_param.weight", "attn.attn_sink"),
    ("ffn.gate.e_score_correction_bias", "ffn.gate.bias"),
)
_NATIVE_PROJ_RE = re.compile(r"^(ffn\.(?:experts\.\d+|shared_experts))\.(gate_proj|up_proj|down_proj)\.(.+)$")
_NATIVE_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def weight_kind(name: str) -> str:
    """"fp32" for the tensors kept in float32 whatever the model dtype (mHC parameters, attention
    sinks, router biases), "quantized" for an Engram table and its scale (kept exactly as stored),
    else "float" (the model dtype)."""
    if _ENGRAM_TABLE_RE.match(name):
        return "quantized"
    return "fp32" if _FP32_RE.search(name) else "float"


def is_quantizable(name: str) -> bool:
    """Whether the canonical weight `name` may be kept quantised (a `QuantizedWeight`)."""
    return _QUANTIZABLE_RE.match(name) is not None


def is_engram_table(name: str) -> bool:
    """Whether a (stored or canonical) name is an Engram table or its scale."""
    return _ENGRAM_TABLE_RE.match(drop_prefix(name, "model.")) is not None


def is_skipped(name: str, keep_dspark: bool = False, keep_vision: bool = False) -> bool:
    """Whether the loader leaves this stored tensor out (`SKIPPED_PREFIXES`; with `keep_dspark`,
    the DSpark drafter's `mtp.*` tensors are loaded, with `keep_vision` the image tower's)."""
    name = drop_prefix(name, "model.")
    kept = (keep_dspark and name.startswith(DSPARK_PREFIX)) or (keep_vision and name.startswith(VISION_PREFIXES))
    return name.startswith(SKIPPED_PREFIXES) and not kept


def _layer_shapes(cfg: DeepseekV41Config, i: int) -> dict[str, tuple[int, ...]]:
    s = _block_shapes(cfg, cfg.layer_roles[i], cfg.compress_ratio(i), cfg.n_routed_experts)
    if i in cfg.engram_layer_ids:
        D, n = cfg.hidden_size, cfg.hc_mult
        rows, hd = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(i)], cfg.engram_head_dim
        s["engram.embed.weight"], s["engram.embed.scale"] = (rows, hd), (rows, hd // ENGRAM_GROUP)
        s["engram.wkv.weight"] = (D * (n + 1), cfg.engram_hash_heads * hd)
        s["engram.q_weight"] = s["engram.k_weight"] = (n, D)
    return {f"layers.{i}.{k}": v for k, v in s.items()}


def _block_shapes(cfg: DeepseekV41Config, role: str, ratio: int, num_experts: int) -> dict[str, tuple[int, ...]]:
    """A block's attention, mHC and MoE tensors (relative names) for a layer of `role` and compress `ratio`."""
    D, H, d, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    mix, E, I = (2 + n) * n, num_experts, cfg.moe_intermediate_size
    Hi, di, q = cfg.index_n_heads, cfg.index_head_dim, cfg.q_lora_rank
    s: dict[str, tuple[int, ...]] = {"attn_norm.weight": (D,), "ffn_norm.weight": (D,)}
    for unit in ("attn", "ffn"):
        s[f"hc_{unit}_fn"], s[f"hc_{unit}_base"], s[f"hc_{unit}_scale"] = (mix, n * D), (mix,), (3,)
    s.update({
        "attn.wq_a.weight": (q, D), "attn.q_norm.weight": (q,), "attn.wq_b.weight": (H * d, q),
        "attn.wkv.weight": (d, D), "attn.kv_norm.weight": (d,),
        "attn.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, H * d // cfg.o_groups),
        "attn.wo_b.weight": (D, cfg.o_groups * cfg.o_lora_rank), "attn.attn_sink": (H,),
    })
    if role == FULL:
        s["attn.compressor.wkv.weight"] = (d, D)
        if ratio > 1:
            s["attn.compressor.wgate.weight"] = (d, D)
        s["attn.compressor.norm.weight"] = (d,)
        s["attn.indexer.wk.weight"] = (di, d)
        s["attn.indexer.k_norm.weight"] = (di,)
    if role in (FULL, REINDEX):
        s["attn.indexer.wq_b.weight"] = (Hi * di, q)
        s["attn.indexer.weights_proj.weight"] = (Hi, D)
    s.update({"ffn.gate.weight": (E, D), "ffn.gate.bias": (E,), "ffn.gate.bias_vl": (E,)})
    s["ffn.shared_experts.w1.weight"] = s["ffn.shared_experts.w3.weight"] = (I, D)
    s["ffn.shared_experts.w2.weight"] = (D, I)
    for e in range(E):
        s[f"ffn.experts.{e}.w1.weight"] = s[f"ffn.experts.{e}.w3.weight"] = (I, D)
        s[f"ffn.experts.{e}.w2.weight"] = (D, I)
    return s


def dspark_weight_shapes(config: DeepseekV41Config) -> dict[str, tuple[int, ...]]:
    """Official name -> shape of every DSpark drafter tensor (`mtp.{j}.*`, dequantised); empty when
    `num_nextn_predict_layers` is 0. Each stage is a sliding-only block with a
    `dspark_n_routed_experts` MoE; `mtp.0` adds the target-feature projection `main_proj`
    (`len(dspark_target_layer_ids) * D -> D`) and `main_norm`; the last stage the final `norm`, the
    Markov head (`markov_head.embed` / `.head`, `[V, dspark_markov_rank]` each) and the fp32
    confidence head (`confidence_head.proj`, `[1, D + rank]`)."""
    V, D, r, S = config.vocab_size, config.hidden_size, config.dspark_markov_rank, config.num_nextn_predict_layers
    shapes: dict[str, tuple[int, ...]] = {}
    for j in range(S):
        s = _block_shapes(config, SLIDING, 0, config.dspark_n_routed_experts)
        if j == 0:
            s["main_proj.weight"] = (D, D * len(config.dspark_target_layer_ids))
            s["main_norm.weight"] = (D,)
        if j == S - 1:
            s["norm.weight"] = (D,)
            s["markov_head.embed.weight"] = s["markov_head.head.weight"] = (V, r)
            s["confidence_head.proj.weight"] = (1, D + r)
        shapes.update({f"mtp.{j}.{k}": v for k, v in s.items()})
    return shapes


def expected_weight_shapes(config: DeepseekV41Config) -> dict[str, tuple[int, ...]]:
    """Official name -> shape of every backbone tensor (dequantised, except the Engram tables and
    their scales, which are the stored shapes). See `weight_kind` for the dtypes."""
    V, D = config.vocab_size, config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (V, D), "norm.weight": (D,), "head.weight": (V, D)}
    for i in range(config.num_hidden_layers):
        shapes.update(_layer_shapes(config, i))
    return shapes


def _official_in_layer(rest: str) -> str:
    rest = rename_prefix(rest, _NATIVE_LAYER)
    m = _NATIVE_PROJ_RE.match(rest)
    return f"{m[1]}.{_NATIVE_PROJ[m[2]]}.{m[3]}" if m else rest


def canonicalize(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official, `model.`-prefixed, transformers-scale or NeMo-native names -> official names
    (NeMo's grouped experts split per expert, transposed back to `[out, in]`)."""
    return canonicalize_blocks(state, _NATIVE_TOP, _BLOCK_RE, _put_block)


def _put_block(out: CanonicalNames, block: str, rest: str, tensor: torch.Tensor) -> None:
    grouped = _GROUPED_RE.match(rest)
    if grouped is None:
        out.put(hf_scale_to_official(f"{block}.{_official_in_layer(rest)}"), tensor)
        return
    for e in range(tensor.shape[0]):
        if grouped[1] == "gate_and_up_projs":  # [D, 2I]: w1^T then w3^T along the last dim
            w1, w3 = tensor[e].chunk(2, dim=-1)
            out.put(f"{block}.ffn.experts.{e}.w1.weight", w1.T)
            out.put(f"{block}.ffn.experts.{e}.w3.weight", w3.T)
        else:  # [I, D] = w2^T
            out.put(f"{block}.ffn.experts.{e}.w2.weight", tensor[e].T)
