"""DeepSeek-V4 tensor naming: official, transformers-internal and save_pretrained names (docs/checkpoints.md).

The canonical naming is the OFFICIAL one, without prefix: `embed.weight`,
`layers.{i}.attn.wq_a.weight`, `layers.{i}.ffn.experts.{e}.w1.weight`, `mtp.0.e_proj.weight`, ...

- `expected_weight_shapes(config)`: every logical (dequantised) tensor the model needs, with shape;
- `weight_kind(name)`: "int" (tid2eid), "fp32" (kept in fp32: sinks, ape, hc_*, gate bias) or "float";
- `is_quantizable(name)`: the weights the model reads only through linear / grouped_linear /
  moe_experts, which may stay quantised for a back end that declares their format;
- `canonicalize(state)`: accepts official names, transformers-internal names
  (`model.layers.i.self_attn.q_a_proj.weight`, fused `mlp.experts.gate_up_proj [E,2I,D]` /
  `down_proj [E,D,I]`) and the hybrid written by transformers' `save_pretrained`, and returns
  official names (fused experts are split). Quantisation scales are kept as `<name>.scale`
  (transformers' `weight_scale_inv` is renamed). Unknown keys pass through with the `model.`
  prefix stripped, so that a loader can report them.
- `to_hf_names(canonical)`: the inverse, transformers-internal names with fused experts; MTP
  tensors stay under their official `mtp.*` names (transformers ignores them).
- `check_weights(canonical, config)`: missing / unexpected / wrong-shape report, raises; then
  `check_hash_tables`: every hash-routing table (`tid2eid`) holds expert ids in [0, n_routed_experts).
"""
from __future__ import annotations

import re

import torch

from deepinfer.models.common.weights import (  # noqa: F401  (fuse_rows, fused_parts, split_fused re-exported)
    CanonicalNames, canonicalize_blocks, fuse_rows, fused_parts, hf_scale_to_official, rename_prefix,
    split_fused, strip_prefix,
)
from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING, CheckpointError, DeepseekV4Config

# in-layer suffixes: transformers-internal prefix -> official prefix (longest first where it matters)
_LAYER_RENAMES: tuple[tuple[str, str], ...] = (
    ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
    ("self_attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("self_attn.compressor.indexer.kv_norm.", "attn.indexer.compressor.norm."),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
    ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."),
    ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.q_a_proj.", "attn.wq_a."),
    ("self_attn.q_a_norm.", "attn.q_norm."),
    ("self_attn.q_b_proj.", "attn.wq_b."),
    ("self_attn.kv_proj.", "attn.wkv."),
    ("self_attn.kv_norm.", "attn.kv_norm."),
    ("self_attn.o_a_proj.", "attn.wo_a."),
    ("self_attn.o_b_proj.", "attn.wo_b."),
    ("attn_hc.fn", "hc_attn_fn"),
    ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"),
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.", "ffn.gate."),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
    ("attn.norm.", "attn.kv_norm."),  # save_pretrained hybrid spelling of the main kv norm
)
# transformers' save_pretrained hybrid spellings of compressor/indexer tensors (measured with 5.24.0);
# consulted by canonicalize only, after _LAYER_RENAMES (added by the checkpoint helper)
_HYBRID_RENAMES: tuple[tuple[str, str], ...] = (
    ("attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("attn.compressor.indexer.wkv.", "attn.indexer.compressor.wkv."),
    ("attn.compressor.indexer.norm.", "attn.indexer.compressor.norm."),
    ("attn.compressor.position_bias", "attn.compressor.ape"),
    ("attn.compressor.gate_proj.", "attn.compressor.wgate."),
)
_TOP_RENAMES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_BLOCK_RE = re.compile(r"^((?:layers|mtp)\.\d+)\.(.+)$")
_FUSED_RE = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv|_scale)?$")
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
# read only through linear / grouped_linear / moe_experts (never indexed, sliced by value or cast)
_QUANTIZABLE_RE = re.compile(
    r"^(head|mtp\.\d+\.(e_proj|h_proj)|(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|compressor\.(wkv|wgate)"
    r"|indexer\.(wq_b|weights_proj|compressor\.(wkv|wgate)))|ffn\.(shared_experts|experts\.\d+)\.w[123]))\.weight$")
_FP32_RE = re.compile(r"(attn_sink|\.ape|(^|\.)hc_[a-z_]+|(^|\.)gate\.bias|(^|\.)gate\.weight|norm\.weight)$")


# Projections of a block that read the same input, fused into one matrix at load time (rows in this
# order, the ones a layer type has): one weight-streaming GEMV instead of up to seven at decode
# (small matrices stream at half the rate of large ones) and one pass over the input in prefill.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "attn.fused_x.weight": ("attn.wq_a.weight", "attn.wkv.weight", "attn.compressor.wkv.weight",
                            "attn.compressor.wgate.weight", "attn.indexer.compressor.wkv.weight",
                            "attn.indexer.compressor.wgate.weight", "attn.indexer.weights_proj.weight"),
    "attn.fused_qr.weight": ("attn.wq_b.weight", "attn.indexer.wq_b.weight"),
    "ffn.fused_shared.weight": ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"),
}


def weight_kind(name: str) -> str:
    """"int" for the hash-routing table, "fp32" for tensors the model keeps in fp32 whatever its
    dtype (sinks, position biases, mHC parameters, norm weights, router weight and bias), else
    "float" (model dtype)."""
    if name.endswith("tid2eid"):
        return "int"
    return "fp32" if _FP32_RE.search(name) else "float"


def is_quantizable(name: str) -> bool:
    """Whether the canonical weight `name` may be kept quantised (a `QuantizedWeight`): it is read
    only as the weight of linear, grouped_linear (`wo_a`) or moe_experts. The embedding, norms, the
    router, mHC and everything indexed are never quantised."""
    return _QUANTIZABLE_RE.match(name) is not None


def _block_shapes(cfg: DeepseekV4Config, prefix: str, layer_type: str, mlp_type: str) -> dict[str, tuple[int, ...]]:
    D, H, d, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    mix, E, I = (2 + n) * n, cfg.n_routed_experts, cfg.moe_intermediate_size
    s: dict[str, tuple[int, ...]] = {}
    for unit in ("attn", "ffn"):
        s[f"hc_{unit}_fn"], s[f"hc_{unit}_base"], s[f"hc_{unit}_scale"] = (mix, n * D), (mix,), (3,)
    s["attn_norm.weight"] = s["ffn_norm.weight"] = (D,)
    s["attn.attn_sink"] = (H,)
    s["attn.wq_a.weight"] = (cfg.q_lora_rank, D)
    s["attn.q_norm.weight"] = (cfg.q_lora_rank,)
    s["attn.wq_b.weight"] = (H * d, cfg.q_lora_rank)
    s["attn.wkv.weight"] = (d, D)
    s["attn.kv_norm.weight"] = (d,)
    s["attn.wo_a.weight"] = (cfg.o_groups * cfg.o_lora_rank, H * d // cfg.o_groups)
    s["attn.wo_b.weight"] = (D, cfg.o_groups * cfg.o_lora_rank)
    if layer_type in (CSA, HCA):
        coff = 2 if layer_type == CSA else 1
        m = cfg.csa_compress_rate if layer_type == CSA else cfg.hca_compress_rate
        s["attn.compressor.ape"] = (m, coff * d)
        s["attn.compressor.wkv.weight"] = s["attn.compressor.wgate.weight"] = (coff * d, D)
        s["attn.compressor.norm.weight"] = (d,)
    if layer_type == CSA:
        Hi, di, m = cfg.index_n_heads, cfg.index_head_dim, cfg.csa_compress_rate
        s["attn.indexer.wq_b.weight"] = (Hi * di, cfg.q_lora_rank)
        s["attn.indexer.weights_proj.weight"] = (Hi, D)
        s["attn.indexer.compressor.ape"] = (m, 2 * di)
        s["attn.indexer.compressor.wkv.weight"] = s["attn.indexer.compressor.wgate.weight"] = (2 * di, D)
        s["attn.indexer.compressor.norm.weight"] = (di,)
    s["ffn.gate.weight"] = (E, D)
    if mlp_type == "hash_moe":
        s["ffn.gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
    else:
        s["ffn.gate.bias"] = (E,)
    if cfg.n_shared_experts:
        s["ffn.shared_experts.w1.weight"] = s["ffn.shared_experts.w3.weight"] = (I, D)
        s["ffn.shared_experts.w2.weight"] = (D, I)
    for e in range(E):
        s[f"ffn.experts.{e}.w1.weight"] = s[f"ffn.experts.{e}.w3.weight"] = (I, D)
        s[f"ffn.experts.{e}.w2.weight"] = (D, I)
    return {f"{prefix}.{k}": v for k, v in s.items()}


def expected_weight_shapes(config: DeepseekV4Config, include_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Official name -> shape of every dequantised tensor of the model (MTP block `mtp.{j}.*`
    included when `num_nextn_predict_layers >= 1` and `include_mtp`). See `weight_kind` for dtypes."""
    D, n, V = config.hidden_size, config.hc_mult, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (V, D), "norm.weight": (D,), "head.weight": (V, D),
        "hc_head_fn": (n, n * D), "hc_head_base": (n,), "hc_head_scale": (1,),
    }
    for i in range(config.num_hidden_layers):
        shapes.update(_block_shapes(config, f"layers.{i}", config.layer_types[i], config.mlp_layer_types[i]))
    if include_mtp:
        for j in range(config.num_nextn_predict_layers):
            p = f"mtp.{j}"
            shapes.update(_block_shapes(config, p, SLIDING, "moe"))
            shapes.update({f"{p}.e_proj.weight": (D, D), f"{p}.h_proj.weight": (D, D),
                           f"{p}.enorm.weight": (D,), f"{p}.hnorm.weight": (D,), f"{p}.norm.weight": (D,),
                           f"{p}.hc_head_fn": (n, n * D), f"{p}.hc_head_base": (n,), f"{p}.hc_head_scale": (1,)})
    return shapes


def canonicalize(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Any of the three naming forms -> official names (fused experts split per expert)."""
    return canonicalize_blocks(state, _TOP_RENAMES, _BLOCK_RE, _put_block)


def _put_block(out: CanonicalNames, block: str, rest: str, tensor: torch.Tensor) -> None:
    fused = _FUSED_RE.match(rest)
    if fused:
        kind, scale = fused.groups()
        leaf = "scale" if scale else "weight"
        for e in range(tensor.shape[0]):
            if kind == "gate_up_proj":
                w1, w3 = tensor[e].chunk(2, dim=0)
                out.put(f"{block}.ffn.experts.{e}.w1.{leaf}", w1)
                out.put(f"{block}.ffn.experts.{e}.w3.{leaf}", w3)
            else:
                out.put(f"{block}.ffn.experts.{e}.w2.{leaf}", tensor[e])
        return
    rest = rename_prefix(rest, _LAYER_RENAMES + _HYBRID_RENAMES)
    if rest.startswith("mlp."):  # unfused per-expert or other mlp.* spellings
        rest = "ffn." + rest[4:]
    out.put(hf_scale_to_official(f"{block}.{rest}"), tensor)


_INVERSE_TOP = {v: k for k, v in _TOP_RENAMES.items()}


def to_hf_names(canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official names -> transformers-internal names with fused experts (for writing checkpoints
    transformers loads). `mtp.*` tensors keep their official names."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in canonical.items():
        if name.startswith("mtp."):
            out[name] = tensor
            continue
        if name in _INVERSE_TOP:
            hf = _INVERSE_TOP[name]
            out[hf if hf == "lm_head.weight" else f"model.{hf}"] = tensor
            continue
        m = _BLOCK_RE.match(name)
        if m is None:
            out[f"model.{name}"] = tensor
            continue
        block, rest = m.groups()
        em = _EXPERT_RE.match(rest)
        if em:
            e, w, leaf = em.groups()
            experts.setdefault((block, leaf), {}).setdefault(int(e), {})[w] = tensor
            continue
        for hf, official in _LAYER_RENAMES:
            if hf == "attn.norm.":  # hybrid-only spelling, never written
                continue
            if rest.startswith(official):
                rest = hf + rest[len(official):]
                break
        if rest.endswith(".scale") and not rest.startswith(("attn_hc.", "ffn_hc.")):
            rest = rest[: -len(".scale")] + ".weight_scale_inv"
        out[f"model.{block}.{rest}"] = tensor
    for (block, leaf), per_expert in experts.items():
        count = max(per_expert) + 1
        missing = [e for e in range(count) if set(per_expert.get(e, {})) != {"w1", "w2", "w3"}]
        if missing:
            raise ValueError(f"{block}: experts {missing} lack one of w1/w2/w3 ({leaf}); cannot fuse them")
        suffix = "" if leaf == "weight" else "_scale_inv"
        gate_up = torch.stack([torch.cat([per_expert[e]["w1"], per_expert[e]["w3"]], dim=0) for e in range(count)])
        down = torch.stack([per_expert[e]["w2"] for e in range(count)])
        out[f"model.{block}.mlp.experts.gate_up_proj{suffix}"] = gate_up
        out[f"model.{block}.mlp.experts.down_proj{suffix}"] = down
    return out


def check_weights(canonical: dict[str, torch.Tensor], config: DeepseekV4Config, include_mtp: bool = True) -> None:
    """Raise ValueError listing missing, unexpected and wrong-shape tensors (dequantised weights;
    `.scale` tensors are ignored). MTP tensors are optional when `include_mtp` is False."""
    expected = expected_weight_shapes(config, include_mtp=include_mtp)
    names = {k for k in canonical if not k.endswith(".scale")}
    if not include_mtp:
        names = {k for k in names if not k.startswith("mtp.")}
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected))
    wrong = sorted(f"{k}: got {tuple(canonical[k].shape)}, expected {expected[k]}"
                   for k in names & set(expected) if tuple(canonical[k].shape) != expected[k])
    if missing or unexpected or wrong:
        def show(xs: list[str]) -> str:
            return ", ".join(xs[:8]) + (f" ... ({len(xs)} in all)" if len(xs) > 8 else "")
        parts = [f"missing: {show(missing)}" if missing else "",
                 f"unexpected: {show(unexpected)}" if unexpected else "",
                 f"wrong shape: {show(wrong)}" if wrong else ""]
        raise ValueError("checkpoint does not match the DeepSeek-V4 config (" + "; ".join(p for p in parts if p)
                         + "). Check that config.json belongs to this checkpoint.")
    check_hash_tables(canonical, config)


def check_hash_tables(canonical: dict[str, torch.Tensor], config: DeepseekV4Config) -> None:
    """Raise CheckpointError unless every hash-routing table (`*.ffn.gate.tid2eid`, token -> expert
    ids) is integer-typed with every value in [0, n_routed_experts): an id outside would only fail
    later, as an IndexError inside generate."""
    E = config.n_routed_experts
    problems = []
    for name in sorted(k for k in canonical if k.endswith("tid2eid")):
        table = canonical[name]
        if table.is_floating_point() or table.is_complex() or table.dtype == torch.bool:
            problems.append(f"{name}: dtype {table.dtype}, expected an integer dtype (expert ids)")
            continue
        bad = (table < 0) | (table >= E)
        if bool(bad.any()):
            first = tuple(bad.nonzero()[0].tolist())  # (token, slot) of the first bad entry
            problems.append(f"{name} holds {int(bad.sum())} expert ids outside [0, {E}) (n_routed_experts = {E}), "
                            f"e.g. token {first[0]} -> expert {int(table[first])}; values range "
                            f"{int(table.min())}..{int(table.max())}")
    if problems:
        raise CheckpointError("hash-routing tables do not fit the config:\n" + "\n".join(f"  {p}" for p in problems)
                              + "\nCheck that config.json (n_routed_experts) belongs to these weights.")
