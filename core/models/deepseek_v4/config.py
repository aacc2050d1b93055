"""DeepSeek-V4 hyperparameters (deepseek-v4.md §2).

`DeepseekV4Config.from_dict` accepts the three spellings found in the wild:
- the official reference `inference/config.json` (`dim`, `n_layers`, `n_heads`, `moe_inter_dim`,
  `n_activated_experts`, `rope_head_dim`, `window_size`, `compress_ratios`, `n_hash_layers`,
  `original_seq_len`/`rope_factor`, ...);
- the hub `config.json` (`hidden_size`, `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
  `rope_scaling`, `sliding_window`, ...);
- transformers' own keys (`layer_types`, `mlp_layer_types`, `compress_rates`, `rope_parameters`,
  `partial_rotary_factor`).
`to_hf_dict()` writes transformers' keys, loadable by `transformers.DeepseekV4Config(**d)`.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

SUPPORTED_MODEL_TYPES = ("deepseek_v4",)
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


class YarnScaling(BaseModel):
    """YaRN frequency interpolation of the compress RoPE (§6). No mscale, attention factor 1."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


class DeepseekV4Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    # per main layer: sliding / CSA / HCA; the MTP block is always sliding-only (§16 item 11)
    layer_types: tuple[str, ...] = ()
    csa_compress_rate: int = 4
    hca_compress_rate: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # MoE
    mlp_layer_types: tuple[str, ...] = ()
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    # RoPE
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = 1048576
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    # checkpoint storage details, passed through for the loader (§13.2)
    quantization_config: dict[str, Any] | None = None
    expert_dtype: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "DeepseekV4Config":
        n = self.num_hidden_layers
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES)):
            if len(types) != n:
                raise ValueError(f"{name} has {len(types)} entries but num_hidden_layers is {n}; give one per layer")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"{name} entries {bad} are not valid; choose from {list(allowed)}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported; choose from {list(SCORING_FUNCS)}")
        if self.head_dim % 2 or self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and within head_dim "
                             f"({self.head_dim})")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must not exceed index_head_dim "
                             f"({self.index_head_dim})")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"num_attention_heads * head_dim must be divisible by o_groups ({self.o_groups})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok must not exceed n_routed_experts")
        if self.n_shared_experts not in (0, 1):
            raise ValueError(f"n_shared_experts must be 0 or 1, got {self.n_shared_experts}")
        if self.csa_compress_rate < 1 or self.hca_compress_rate < 1:
            raise ValueError("compress rates must be positive")
        if self.num_nextn_predict_layers < 0:
            raise ValueError("num_nextn_predict_layers must be >= 0")
        return self

    # ----- derived -----
    def compress_ratio_for(self, layer_type: str) -> int:
        """0 for sliding-only layers, else the compression rate m of that layer type."""
        return 0 if layer_type == SLIDING else self.csa_compress_rate if layer_type == CSA else self.hca_compress_rate

    def compress_ratio(self, layer: int) -> int:
        return self.compress_ratio_for(self.layer_types[layer])

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        """Official-style per-layer ratios, one per main layer plus one (0) per MTP layer."""
        main = tuple(self.compress_ratio(i) for i in range(self.num_hidden_layers))
        return main + (0,) * self.num_nextn_predict_layers

    # ----- parsing -----
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekV4Config":
        d = dict(d)
        model_type = d.pop("model_type", "deepseek_v4")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported by this model; supported: "
                             f"{list(SUPPORTED_MODEL_TYPES)}")
        get = _KeyReader(d)
        n_layers = get.int("num_hidden_layers", "n_layers", default=43)
        out: dict[str, Any] = {
            "vocab_size": get.int("vocab_size", default=129280),
            "hidden_size": get.int("hidden_size", "dim", default=4096),
            "num_hidden_layers": n_layers,
            "num_attention_heads": get.int("num_attention_heads", "n_heads", default=64),
            "head_dim": get.int("head_dim", default=512),
            "q_lora_rank": get.int("q_lora_rank", default=1024),
            "o_groups": get.int("o_groups", default=8),
            "o_lora_rank": get.int("o_lora_rank", default=1024),
            "sliding_window": get.int("sliding_window", "window_size", default=128),
            "index_n_heads": get.int("index_n_heads", default=64),
            "index_head_dim": get.int("index_head_dim", default=128),
            "index_topk": get.int("index_topk", default=512),
            "n_routed_experts": get.int("n_routed_experts", "num_local_experts", default=256),
            "num_experts_per_tok": get.int("num_experts_per_tok", "n_activated_experts", default=6),
            "n_shared_experts": get.int("n_shared_experts", default=1),
            "moe_intermediate_size": get.int("moe_intermediate_size", "moe_inter_dim", "intermediate_size",
                                             default=2048),
            "scoring_func": get.any("scoring_func", "score_func", default="sqrtsoftplus"),
            "routed_scaling_factor": get.float("routed_scaling_factor", "route_scale", default=1.5),
            "swiglu_limit": get.float("swiglu_limit", default=10.0),
            "rope_theta": get.float("rope_theta", default=10000.0),
            "compress_rope_theta": get.float("compress_rope_theta", default=160000.0),
            "max_position_embeddings": get.int("max_position_embeddings", "max_seq_len", default=1048576),
            "hc_mult": get.int("hc_mult", default=4),
            "hc_sinkhorn_iters": get.int("hc_sinkhorn_iters", default=20),
            "hc_eps": get.float("hc_eps", default=1e-6),
            "rms_norm_eps": get.float("rms_norm_eps", "norm_eps", default=1e-6),
            "num_nextn_predict_layers": get.int("num_nextn_predict_layers", "n_mtp_layers", default=1),
            "bos_token_id": get.any("bos_token_id", default=0),
            "eos_token_id": get.any("eos_token_id", default=1),
            "quantization_config": get.any("quantization_config", default=None),
            "expert_dtype": get.any("expert_dtype", default=None),
        }
        if isinstance(out["eos_token_id"], list):
            out["eos_token_id"] = tuple(out["eos_token_id"])
        if out["expert_dtype"] is None and isinstance(out["quantization_config"], dict):
            out["expert_dtype"] = out["quantization_config"].get("expert_dtype")
        norm_topk = get.any("norm_topk_prob", default=True)
        if norm_topk is not True:
            raise ValueError("norm_topk_prob must be true for DeepSeek-V4 (routing weights are always normalised)")

        # rotary dims: explicit > partial_rotary_factor * head_dim > default 64
        rope_dim = get.any("qk_rope_head_dim", "rope_head_dim", default=None)
        prf = get.any("partial_rotary_factor", default=None)
        rope_params = get.any("rope_parameters", default=None)
        if rope_dim is None and prf is None and isinstance(rope_params, dict):
            prf = (rope_params.get("compress") or rope_params.get("main") or rope_params).get("partial_rotary_factor")
        if rope_dim is None:
            rope_dim = int(out["head_dim"] * prf) if prf is not None else 64
        out["qk_rope_head_dim"] = int(rope_dim)

        # compression schedule
        rates = get.any("compress_rates", default=None) or {}
        csa_rate = int(rates.get(CSA, get.any("compress_rate_csa", default=4)))
        hca_rate = int(rates.get(HCA, get.any("compress_rate_hca", default=128)))
        layer_types = get.any("layer_types", default=None)
        ratios = get.any("compress_ratios", default=None)
        if layer_types is None and ratios is not None:
            ratios = [int(r) for r in ratios]
            layer_types, csa_rate, hca_rate = _types_from_ratios(ratios[:n_layers], csa_rate, hca_rate)
            if len(ratios) > n_layers and any(r != 0 for r in ratios[n_layers:]):
                raise ValueError(f"compress_ratios entries for the MTP layers must be 0 (sliding-only), got "
                                 f"{ratios[n_layers:]}")
        if layer_types is None:  # transformers' default: 2 HCA then CSA/HCA interleaved
            layer_types = [HCA] * min(n_layers, 2) + [CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0))]
        out["layer_types"] = tuple(layer_types[:n_layers])
        out["csa_compress_rate"], out["hca_compress_rate"] = csa_rate, hca_rate

        mlp_types = get.any("mlp_layer_types", default=None)
        if mlp_types is None:
            n_hash = get.int("num_hash_layers", "n_hash_layers", default=3)
            mlp_types = ["hash_moe"] * min(n_layers, n_hash) + ["moe"] * max(0, n_layers - n_hash)
        out["mlp_layer_types"] = tuple(mlp_types[:n_layers])

        out["rope_scaling"] = _parse_yarn(get.any("rope_scaling", default=None), rope_params, d)
        for k in ("original_seq_len", "rope_factor", "beta_fast", "beta_slow"):
            d.pop(k, None)
        return cls(**out)

    def to_hf_dict(self) -> dict[str, Any]:
        """transformers' DeepseekV4Config keys (model_type "deepseek_v4")."""
        main = {"rope_type": "default", "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim}
        compress = {"rope_type": "default", "rope_theta": self.compress_rope_theta,
                    "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim}
        if self.rope_scaling is not None:
            y = self.rope_scaling
            compress.update(rope_type="yarn", factor=y.factor, beta_fast=y.beta_fast, beta_slow=y.beta_slow,
                            original_max_position_embeddings=y.original_max_position_embeddings,
                            attention_factor=1.0)
        d: dict[str, Any] = {
            "model_type": "deepseek_v4",
            "architectures": ["DeepseekV4ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "compress_rates": {CSA: self.csa_compress_rate, HCA: self.hca_compress_rate},
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "mlp_layer_types": list(self.mlp_layer_types),
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "scoring_func": self.scoring_func,
            "norm_topk_prob": True,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_parameters": {"main": main, "compress": compress},
            "max_position_embeddings": self.max_position_embeddings,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "tie_word_embeddings": False,
        }
        if self.quantization_config is not None:
            d["quantization_config"] = dict(self.quantization_config)
        return d


class _KeyReader:
    """Reads a key under any of its aliases; two aliases with different values is an error."""

    def __init__(self, d: dict[str, Any]):
        self.d = d

    def any(self, *names: str, default: Any) -> Any:
        found = [(n, self.d[n]) for n in names if n in self.d and self.d[n] is not None]
        if len({repr(v) for _, v in found}) > 1:
            raise ValueError(f"config keys {[n for n, _ in found]} are aliases but disagree: {dict(found)}")
        return found[0][1] if found else default

    def int(self, *names: str, default: int) -> int:
        return int(self.any(*names, default=default))

    def float(self, *names: str, default: float) -> float:
        return float(self.any(*names, default=default))


def _types_from_ratios(ratios: list[int], csa_rate: int, hca_rate: int) -> tuple[list[str], int, int]:
    """Official `compress_ratios`: 0 = sliding; the overlapping CSA rate is 4 (as in the official
    reference, overlap iff ratio == 4); any other positive ratio is HCA."""
    types = []
    hca_rates = {r for r in ratios if r not in (0, 4)}
    if len(hca_rates) > 1:
        raise ValueError(f"compress_ratios holds several HCA rates {sorted(hca_rates)}; all HCA layers must share one")
    for r in ratios:
        if r < 0:
            raise ValueError(f"compress_ratios entries must be >= 0, got {r}")
        types.append(SLIDING if r == 0 else CSA if r == 4 else HCA)
    if 4 in ratios:
        csa_rate = 4
    if hca_rates:
        hca_rate = hca_rates.pop()
    return types, csa_rate, hca_rate


def _parse_yarn(rope_scaling: Any, rope_params: Any, d: dict[str, Any]) -> YarnScaling | None:
    src = None
    if isinstance(rope_params, dict) and isinstance(rope_params.get("compress"), dict):
        src = rope_params["compress"]
    elif isinstance(rope_scaling, dict):
        src = rope_scaling
    elif isinstance(rope_params, dict) and rope_params:
        src = rope_params
    if src is not None:
        kind = src.get("rope_type", src.get("type", "default"))
        if kind in ("default", None):
            return None
        if kind != "yarn":
            raise ValueError(f"rope scaling type {kind!r} is not supported for DeepSeek-V4; choose 'yarn' or none")
        if src.get("mscale") or src.get("mscale_all_dim"):
            raise ValueError("YaRN mscale is not used by DeepSeek-V4; remove mscale/mscale_all_dim")
        if src.get("attention_factor") not in (None, 1.0, 1):
            raise ValueError("DeepSeek-V4 uses YaRN with attention_factor 1.0")
        return YarnScaling(factor=float(src["factor"]),
                           original_max_position_embeddings=int(src["original_max_position_embeddings"]),
                           beta_fast=float(src.get("beta_fast") or 32), beta_slow=float(src.get("beta_slow") or 1))
    # official inference/config.json style
    if int(d.get("original_seq_len", 0) or 0) > 0:
        return YarnScaling(factor=float(d.get("rope_factor", 40)),
                           original_max_position_embeddings=int(d["original_seq_len"]),
                           beta_fast=float(d.get("beta_fast", 32)), beta_slow=float(d.get("beta_slow", 1)))
    return None
