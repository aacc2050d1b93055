"""DeepSeek-V4 hyperparameters (`DeepseekV4Config`).

`DeepseekV4Config.from_dict` accepts the three spellings found in the wild:
- the official reference `inference/config.json` (`dim`, `n_layers`, `n_heads`, `moe_inter_dim`,
  `n_activated_experts`, `rope_head_dim`, `window_size`, `compress_ratios`, `n_hash_layers`,
  `original_seq_len`/`rope_factor`, ...);
- the hub `config.json` (`hidden_size`, `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
  `rope_scaling`, `sliding_window`, ...);
- transformers' own keys (`layer_types`, `mlp_layer_types`, `compress_rates`, `rope_parameters`,
  `partial_rotary_factor`).
`to_hf_dict()` writes transformers' keys, loadable by `transformers.DeepseekV4Config(**d)`.

Every value is type- and range-checked when the config is parsed or built (`FIELD_RANGES`,
`YARN_RANGES`, `PARSE_RANGES`, then the cross-field rules of `_cross_field_problems`): integers must
be ints (not bool, float or str), floats finite numbers. `from_dict` reports every problem in one
`CheckpointError` naming the key as spelt in the file, the bad value and the valid range; building
`DeepseekV4Config(...)` directly raises pydantic's ValidationError with the same sentences.
"""
from __future__ import annotations

import numbers
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from deepinfer.models.common.config_values import (
    MAX_COMPRESS_RATE, MAX_DRAFT_LAYERS, MAX_EXPERTS, MAX_HC_MULT, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS,
    MAX_POSITIONS, MAX_SINKHORN_ITERS, MAX_VOCAB, MAX_WIDTH, Range, quantization_problems, tied_embeddings_problem,
    token_ids_problem,
)
from deepinfer.models.common.config_values import plain_number as _plain  # noqa: F401  (re-exported)
from deepinfer.models.common.config_values import range_problems as _range_problems
from deepinfer.models.common.config_values import report as _report
from deepinfer.models.common.config_values import show_value as _show
from deepinfer.models.common.config_values import type_name as _type_name
from deepinfer.models.common.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("deepseek_v4",)
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


# --- value ranges ------------------------------------------------------------------------------
# `Range` and the message helpers are shared by every family (common/config_values.py); the names
# below are kept for the code (and tests) that import them from here.

# Every numeric DeepseekV4Config field, with what the model code needs of it. Cross-field rules
# (divisibility, top-k <= experts, rotary dims, token ids < vocab_size) are in `_cross_field_problems`.
FIELD_RANGES: dict[str, Range] = {
    "vocab_size": Range(int, 1, MAX_VOCAB),
    "hidden_size": Range(int, 1, MAX_WIDTH),
    "num_hidden_layers": Range(int, 1, MAX_LAYERS),
    "num_attention_heads": Range(int, 1, MAX_HEADS),
    "head_dim": Range(int, 2, MAX_HEAD_DIM),
    "qk_rope_head_dim": Range(int, 2, MAX_HEAD_DIM),
    "q_lora_rank": Range(int, 1, MAX_WIDTH),
    "o_groups": Range(int, 1, MAX_HEADS),
    "o_lora_rank": Range(int, 1, MAX_WIDTH),
    "sliding_window": Range(int, 1, MAX_POSITIONS),  # the window ring holds sliding_window keys per sequence
    "csa_compress_rate": Range(int, 1, MAX_COMPRESS_RATE),
    "hca_compress_rate": Range(int, 1, MAX_COMPRESS_RATE),
    "index_n_heads": Range(int, 1, MAX_HEADS),
    "index_head_dim": Range(int, 2, MAX_HEAD_DIM),
    "index_topk": Range(int, 1, MAX_POSITIONS),
    "n_routed_experts": Range(int, 1, MAX_EXPERTS),
    "num_experts_per_tok": Range(int, 1, MAX_HEADS),
    "n_shared_experts": Range(int, 0, 1),  # the shared expert is one fused matrix, or none
    "moe_intermediate_size": Range(int, 1, MAX_WIDTH),
    "routed_scaling_factor": Range(float, 0, open_low=True),
    "swiglu_limit": Range(float, 0),  # 0 = no clamp
    "rope_theta": Range(float, 1, open_low=True),  # log(base) divides in the YaRN ramp
    "compress_rope_theta": Range(float, 1, open_low=True),
    "max_position_embeddings": Range(int, 1, MAX_POSITIONS),
    "hc_mult": Range(int, 1, MAX_HC_MULT),
    "hc_sinkhorn_iters": Range(int, 1, MAX_SINKHORN_ITERS),  # the first normalisation always runs
    "hc_eps": Range(float, 0),
    "rms_norm_eps": Range(float, 0),
    "num_nextn_predict_layers": Range(int, 0, MAX_DRAFT_LAYERS),
}
YARN_RANGES: dict[str, Range] = {
    "factor": Range(float, 1),
    "original_max_position_embeddings": Range(int, 1, MAX_POSITIONS),
    "beta_fast": Range(float, 0, open_low=True),
    "beta_slow": Range(float, 0, open_low=True),
}
# keys that only steer parsing (official / transformers spellings)
PARSE_RANGES: dict[str, Range] = {
    "num_hash_layers": Range(int, 0, MAX_LAYERS),  # and at most num_hidden_layers
    "partial_rotary_factor": Range(float, 0, 1, open_low=True),
    "compress_ratios": Range(int, 0, MAX_COMPRESS_RATE),  # per entry
    "compress_rates": Range(int, 1, MAX_COMPRESS_RATE),  # per entry
    "original_seq_len": Range(int, 0, MAX_POSITIONS),  # 0 = no YaRN
    "rope_factor": Range(float, 1),
    "beta_fast": YARN_RANGES["beta_fast"],
    "beta_slow": YARN_RANGES["beta_slow"],
}
EXPERT_DTYPES = ("fp4", "fp8")


def _token_id_problem(key: str, value: Any, many: bool) -> str | None:
    ids = list(value) if many and isinstance(value, (list, tuple)) else [value]
    if value is None or all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
        return None
    return (f"{key} = {_show(value)} has the wrong type ({_type_name(value)}): must be an integer token id"
            f"{', a list of them' if many else ''} or null")


def _validation_problems(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, ValueError):
            out += str(cause).splitlines()
        else:
            where = ".".join(str(p) for p in e["loc"]) or "config"
            out.append(f"{where} = {_show(e.get('input'))}: {e['msg']}")
    return out


class YarnScaling(BaseModel):
    """YaRN frequency interpolation of the compress RoPE (`rope.py`). No mscale, attention factor 1."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    @model_validator(mode="before")
    @classmethod
    def _check_values(cls, data: Any) -> Any:
        if isinstance(data, dict) and (problems := _range_problems(data, YARN_RANGES)):
            raise ValueError("\n".join(problems))
        return data


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
    # per main layer: sliding / CSA / HCA; the MTP block is always sliding-only, whatever the list says
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
    # checkpoint storage details (FP8 / FP4 formats, docs/checkpoints.md), passed through for the loader
    quantization_config: dict[str, Any] | None = None
    expert_dtype: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_values(cls, data: Any) -> Any:
        """Types and ranges of the given values (FIELD_RANGES), before pydantic would coerce them."""
        if isinstance(data, dict):
            problems = _range_problems(data, FIELD_RANGES)
            for key, many in (("bos_token_id", False), ("eos_token_id", True)):
                if key in data and (p := _token_id_problem(key, data[key], many)) is not None:
                    problems.append(p)
            if problems:
                raise ValueError("\n".join(problems))
        return data

    @model_validator(mode="after")
    def _check(self) -> "DeepseekV4Config":
        problems = self._cross_field_problems()
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _cross_field_problems(self) -> list[str]:
        problems = []
        n = self.num_hidden_layers
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES)):
            if len(types) != n:
                problems.append(f"{name} has {len(types)} entries but num_hidden_layers is {n}; give one per layer")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                problems.append(f"{name} entries {bad} are not valid; choose from {list(allowed)}")
        if self.scoring_func not in SCORING_FUNCS:
            problems.append(f"scoring_func = {self.scoring_func!r} is not supported; choose from {list(SCORING_FUNCS)}")
        d, r, di = self.head_dim, self.qk_rope_head_dim, self.index_head_dim
        if d % 2:
            problems.append(f"head_dim = {d} is not valid: must be even")
        if r % 2 or r > d:
            problems.append(f"qk_rope_head_dim = {r} is out of range: must be even and <= head_dim = {d}")
        if r > di:
            problems.append(f"qk_rope_head_dim = {r} is out of range: must be <= index_head_dim = {di} (the "
                            f"indexer rotates its queries and keys too)")
        hd = self.num_attention_heads * d
        if hd % self.o_groups:
            problems.append(f"o_groups = {self.o_groups} is not valid: must divide num_attention_heads * head_dim "
                            f"= {hd}")
        if self.num_experts_per_tok > self.n_routed_experts:
            problems.append(f"num_experts_per_tok = {self.num_experts_per_tok} is out of range: must be <= "
                            f"n_routed_experts = {self.n_routed_experts}")
        for key, value in (("bos_token_id", self.bos_token_id), ("eos_token_id", self.eos_token_id)):
            if (p := token_ids_problem(key, value, self.vocab_size)) is not None:
                problems.append(p)
        problems += quantization_problems(self.quantization_config)
        if self.expert_dtype not in (None, *EXPERT_DTYPES):
            problems.append(f"expert_dtype = {_show(self.expert_dtype)} is not supported: choose "
                            f"{' or '.join(map(repr, EXPERT_DTYPES))} (or leave it out)")
        return problems

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
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "DeepseekV4Config":
        """Parse a config dict in any of the three spellings. Every value is type- and range-checked
        (FIELD_RANGES, PARSE_RANGES, YARN_RANGES and the cross-field rules); all problems are
        reported together in one CheckpointError, prefixed with `source`."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source} must hold a JSON object with the model's settings (got {_type_name(d)})")
        d = dict(d)
        model_type = d.pop("model_type", "deepseek_v4")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(f"{source}: model_type {model_type!r} is not supported by this model; supported: "
                                  f"{list(SUPPORTED_MODEL_TYPES)}")
        get = _KeyReader(d)
        n_layers = get.number("num_hidden_layers", "n_layers", default=43)
        out: dict[str, Any] = {
            "vocab_size": get.number("vocab_size", default=129280),
            "hidden_size": get.number("hidden_size", "dim", default=4096),
            "num_hidden_layers": n_layers,
            "num_attention_heads": get.number("num_attention_heads", "n_heads", default=64),
            "head_dim": get.number("head_dim", default=512),
            "q_lora_rank": get.number("q_lora_rank", default=1024),
            "o_groups": get.number("o_groups", default=8),
            "o_lora_rank": get.number("o_lora_rank", default=1024),
            "sliding_window": get.number("sliding_window", "window_size", default=128),
            "index_n_heads": get.number("index_n_heads", default=64),
            "index_head_dim": get.number("index_head_dim", default=128),
            "index_topk": get.number("index_topk", default=512),
            "n_routed_experts": get.number("n_routed_experts", "num_local_experts", default=256),
            "num_experts_per_tok": get.number("num_experts_per_tok", "n_activated_experts", default=6),
            "n_shared_experts": get.number("n_shared_experts", default=1),
            "moe_intermediate_size": get.number("moe_intermediate_size", "moe_inter_dim", "intermediate_size",
                                                default=2048),
            "scoring_func": get.typed("scoring_func", "score_func", default="sqrtsoftplus", kinds=str,
                                      want=f"one of {list(SCORING_FUNCS)}"),
            "routed_scaling_factor": get.number("routed_scaling_factor", "route_scale", default=1.5),
            "swiglu_limit": get.number("swiglu_limit", default=10.0),
            "rope_theta": get.number("rope_theta", default=10000.0),
            "compress_rope_theta": get.number("compress_rope_theta", default=160000.0),
            "max_position_embeddings": get.number("max_position_embeddings", "max_seq_len", default=1048576),
            "hc_mult": get.number("hc_mult", default=4),
            "hc_sinkhorn_iters": get.number("hc_sinkhorn_iters", default=20),
            "hc_eps": get.number("hc_eps", default=1e-6),
            "rms_norm_eps": get.number("rms_norm_eps", "norm_eps", default=1e-6),
            "num_nextn_predict_layers": get.number("num_nextn_predict_layers", "n_mtp_layers", default=1),
            "bos_token_id": get.token_ids("bos_token_id", default=0, many=False),
            "eos_token_id": get.token_ids("eos_token_id", default=1, many=True),
            "quantization_config": get.typed("quantization_config", default=None, kinds=dict, want="an object or null"),
            "expert_dtype": get.typed("expert_dtype", default=None, kinds=str, want="a string or null"),
        }
        if isinstance(out["eos_token_id"], list):
            out["eos_token_id"] = tuple(out["eos_token_id"])
        if out["expert_dtype"] is None and isinstance(out["quantization_config"], dict):
            out["expert_dtype"] = get.check("quantization_config.expert_dtype",
                                            out["quantization_config"].get("expert_dtype"), None, kinds=str,
                                            want="a string or null")
        if (p := tied_embeddings_problem("tie_word_embeddings", d.get("tie_word_embeddings"))) is not None:
            get.problems.append(p)
        norm_topk = get.lookup("norm_topk_prob", default=True)[1]
        if norm_topk is not True:
            get.problems.append(f"norm_topk_prob = {_show(norm_topk)} is not supported: must be true for DeepSeek-V4 "
                                f"(routing weights are always normalised)")

        # rotary dims: explicit > partial_rotary_factor * head_dim > default 64
        rope_dim = get.number("qk_rope_head_dim", "rope_head_dim", default=None)
        prf = get.number("partial_rotary_factor", default=None)
        rope_params = get.typed("rope_parameters", default=None, kinds=dict, want="an object or null")
        if rope_dim is None and prf is None and rope_params is not None:
            inner = rope_params.get("compress") or rope_params.get("main") or rope_params
            if isinstance(inner, dict) and inner.get("partial_rotary_factor") is not None:
                prf = get.check("rope_parameters.partial_rotary_factor", inner["partial_rotary_factor"], None,
                                rng=PARSE_RANGES["partial_rotary_factor"])
        if rope_dim is None:
            rope_dim = int(out["head_dim"] * prf) if prf is not None else 64
        out["qk_rope_head_dim"] = rope_dim

        # compression schedule
        rates = get.typed("compress_rates", default=None, kinds=dict, want="an object or null") or {}
        csa_rate = get.check(f"compress_rates.{CSA}", rates.get(CSA), None, rng=PARSE_RANGES["compress_rates"])
        hca_rate = get.check(f"compress_rates.{HCA}", rates.get(HCA), None, rng=PARSE_RANGES["compress_rates"])
        csa_rate = csa_rate if csa_rate is not None else get.number("compress_rate_csa", default=4,
                                                                     rng=PARSE_RANGES["compress_rates"])
        hca_rate = hca_rate if hca_rate is not None else get.number("compress_rate_hca", default=128,
                                                                     rng=PARSE_RANGES["compress_rates"])
        layer_types = get.str_list("layer_types")
        ratios = get.int_list("compress_ratios", PARSE_RANGES["compress_ratios"])
        n_mtp = out["num_nextn_predict_layers"]
        if ratios is not None and len(ratios) not in (n_layers, n_layers + n_mtp):
            get.problems.append(f"compress_ratios has {len(ratios)} entries: give one per layer, num_hidden_layers = "
                                f"{n_layers} (optionally followed by one 0 per MTP layer, "
                                f"num_nextn_predict_layers = {n_mtp})")
            ratios = None
        if layer_types is None and ratios is not None:
            try:
                layer_types, csa_rate, hca_rate = _types_from_ratios(ratios[:n_layers], csa_rate, hca_rate)
            except CheckpointError as e:
                get.problems.append(str(e))
                layer_types = None
            if len(ratios) > n_layers and any(r != 0 for r in ratios[n_layers:]):
                get.problems.append(f"compress_ratios = {_show(ratios)} is not valid: the entries for the MTP layers "
                                    f"(after the first {n_layers}) must be 0 (sliding-only), got {ratios[n_layers:]}")
        if layer_types is None:  # transformers' default: 2 HCA then CSA/HCA interleaved
            layer_types = [HCA] * min(n_layers, 2) + [CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0))]
        out["layer_types"] = tuple(layer_types[:n_layers])
        out["csa_compress_rate"], out["hca_compress_rate"] = csa_rate, hca_rate

        mlp_types = get.str_list("mlp_layer_types")
        if mlp_types is None:
            n_hash = get.number("num_hash_layers", "n_hash_layers", default=min(3, n_layers),
                                rng=PARSE_RANGES["num_hash_layers"])
            if n_hash > n_layers:
                key = get.lookup("num_hash_layers", "n_hash_layers", default=None)[0]
                get.problems.append(f"{key} = {n_hash} is out of range: must be <= num_hidden_layers = {n_layers}")
            mlp_types = ["hash_moe"] * min(n_layers, n_hash) + ["moe"] * max(0, n_layers - n_hash)
        out["mlp_layer_types"] = tuple(mlp_types[:n_layers])

        rope_scaling = get.typed("rope_scaling", default=None, kinds=dict, want="an object or null")
        out["rope_scaling"] = _parse_yarn(get, rope_scaling, rope_params)
        _check_rope_bases(get, rope_params, out)
        if get.problems:
            raise CheckpointError(_report(source, get.problems))
        try:
            return cls(**out)
        except ValidationError as e:
            raise CheckpointError(_report(source, _validation_problems(e))) from None

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

    def to_hub_dict(self) -> dict[str, Any]:
        """The released checkpoint's `config.json` keys (`compress_ratios`, `num_hash_layers`,
        `qk_rope_head_dim`, `rope_scaling`), which other engines' converters (llama.cpp's) require.
        Raises ValueError for a schedule those keys cannot express (hash layers not a prefix; a CSA
        rate other than 4, which the official format implies by ratio 4)."""
        n_hash = sum(t == "hash_moe" for t in self.mlp_layer_types)
        if any(t != "hash_moe" for t in self.mlp_layer_types[:n_hash]):
            raise ValueError(f"mlp_layer_types = {list(self.mlp_layer_types)} cannot be written as num_hash_layers: "
                             f"the hash layers must come first")
        if CSA in self.layer_types and self.csa_compress_rate != 4:
            raise ValueError(f"csa_compress_rate = {self.csa_compress_rate} cannot be written as compress_ratios: "
                             f"the official format reads ratio 4 as CSA")
        d = {k: v for k, v in self.to_hf_dict().items()
             if k not in ("layer_types", "compress_rates", "mlp_layer_types", "rope_parameters",
                          "partial_rotary_factor")}
        d.update(qk_rope_head_dim=self.qk_rope_head_dim, compress_ratios=list(self.compress_ratios),
                 num_hash_layers=n_hash, topk_method="noaux_tc")
        if self.rope_scaling is not None:
            y = self.rope_scaling
            d["rope_scaling"] = {"type": "yarn", "factor": y.factor, "beta_fast": y.beta_fast,
                                 "beta_slow": y.beta_slow,
                                 "original_max_position_embeddings": y.original_max_position_embeddings}
        if self.expert_dtype is not None:
            d["expert_dtype"] = self.expert_dtype
        return d


class _KeyReader:
    """Reads a key under any of its aliases and checks its type and range; two aliases with
    different values is an error. Problems are collected in `problems` (named by the key as it is
    spelt in the file), and the default is used in their place so that parsing goes on and every
    problem is reported at once."""

    def __init__(self, d: dict[str, Any]):
        self.d = d
        self.problems: list[str] = []

    def lookup(self, *names: str, default: Any) -> tuple[str | None, Any]:
        """(the key found, its value), or (None, default). None values count as absent."""
        found = [(n, self.d[n]) for n in names if n in self.d and self.d[n] is not None]
        if len({repr(v) for _, v in found}) > 1:
            self.problems.append(f"config keys {[n for n, _ in found]} are aliases but disagree: {dict(found)}")
        return found[0] if found else (None, default)

    def check(self, key: str, value: Any, default: Any, rng: Range | None = None, kinds: type | tuple = (),
              want: str = "") -> Any:
        """`value` if it is valid (a number in `rng`, or an instance of `kinds`), else `default`
        and a problem. None is absent: `default`."""
        if value is None:
            return default
        if rng is not None:
            problem = rng.problem(key, value)
        elif isinstance(value, kinds) and not isinstance(value, bool):
            problem = None
        else:
            problem = f"{key} = {_show(value)} has the wrong type ({_type_name(value)}): must be {want}"
        if problem is not None:
            self.problems.append(problem)
            return default
        return value

    def number(self, *names: str, default: Any, rng: Range | None = None) -> Any:
        """A numeric setting; the range is FIELD_RANGES / PARSE_RANGES of the first name unless given."""
        rng = rng or FIELD_RANGES.get(names[0]) or PARSE_RANGES[names[0]]
        key, value = self.lookup(*names, default=None)
        value = self.check(key or names[0], value, default, rng=rng)
        return None if value is None else rng.kind(value)

    def typed(self, *names: str, default: Any, kinds: type | tuple, want: str) -> Any:
        key, value = self.lookup(*names, default=None)
        return self.check(key or names[0], value, default, kinds=kinds, want=want)

    def token_ids(self, name: str, default: Any, many: bool) -> Any:
        _, value = self.lookup(name, default=default)
        problem = _token_id_problem(name, value, many)
        if problem is not None:
            self.problems.append(problem)
            return default
        return value

    def str_list(self, name: str) -> list[str] | None:
        _, value = self.lookup(name, default=None)
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            self.problems.append(f"{name} = {_show(value)} has the wrong type ({_type_name(value)}): must be a list "
                                 f"of strings, one per layer")
            return None
        return list(value)

    def int_list(self, name: str, rng: Range) -> list[int] | None:
        _, value = self.lookup(name, default=None)
        if value is None:
            return None
        if not isinstance(value, (list, tuple)):
            self.problems.append(f"{name} = {_show(value)} has the wrong type ({_type_name(value)}): must be a list "
                                 f"of {rng.describe().replace('an integer', 'integers')}")
            return None
        problems = [p for i, v in enumerate(value) if (p := rng.problem(f"{name}[{i}]", v)) is not None]
        if problems:
            self.problems += [f"{p} (in {name} = {_show(value)})" for p in problems]
            return None
        return [int(v) for v in value]


def _types_from_ratios(ratios: list[int], csa_rate: int, hca_rate: int) -> tuple[list[str], int, int]:
    """Official `compress_ratios` (entries already checked >= 0): 0 = sliding; the overlapping CSA
    rate is 4 (as in the official reference, overlap iff ratio == 4); any other positive ratio is HCA."""
    hca_rates = {r for r in ratios if r not in (0, 4)}
    if len(hca_rates) > 1:
        raise CheckpointError(f"compress_ratios = {_show(ratios)} is not valid: it holds several HCA rates "
                              f"{sorted(hca_rates)}; all HCA layers must share one")
    types = [SLIDING if r == 0 else CSA if r == 4 else HCA for r in ratios]
    if 4 in ratios:
        csa_rate = 4
    if hca_rates:
        hca_rate = hca_rates.pop()
    return types, csa_rate, hca_rate


def _parse_yarn(get: _KeyReader, rope_scaling: dict | None, rope_params: dict | None) -> YarnScaling | None:
    """The compress RoPE's YaRN scaling: from `rope_parameters.compress` (transformers), `rope_scaling`
    (hub) or the official keys. When both of the first two are given they must agree: neither is
    silently dropped."""
    sources = []
    if rope_params is not None and isinstance(rope_params.get("compress"), dict):
        sources.append((rope_params["compress"], "rope_parameters.compress"))
    if rope_scaling is not None:
        sources.append((rope_scaling, "rope_scaling"))
    if not sources and rope_params:
        sources.append((rope_params, "rope_parameters"))
    if sources:
        before = len(get.problems)
        parsed = [_yarn_block(get, src, where) for src, where in sources]
        if len(parsed) == 2 and parsed[0] != parsed[1] and len(get.problems) == before:
            get.problems.append(f"rope_parameters.compress and rope_scaling disagree ({_show(sources[0][0])} vs "
                                f"{_show(sources[1][0])}); give the compress RoPE's scaling once")
        return parsed[0]
    # official inference/config.json style
    original = get.number("original_seq_len", default=0)
    factor = get.number("rope_factor", default=40.0)  # checked even when unused (original_seq_len 0)
    if original:
        values = {"factor": factor, "original_max_position_embeddings": original,
                  "beta_fast": get.number("beta_fast", default=32.0), "beta_slow": get.number("beta_slow", default=1.0)}
        return None if get.problems else YarnScaling(**values)
    return None


def _check_rope_bases(get: _KeyReader, rope_params: dict | None, out: dict[str, Any]) -> None:
    """transformers' `rope_parameters` repeats the RoPE bases: they must agree with the ones read
    (`rope_theta`, `compress_rope_theta`), and the main RoPE is never scaled; nothing there is ignored."""
    for block, key in (("main", "rope_theta"), ("compress", "compress_rope_theta")):
        inner = (rope_params or {}).get(block)
        theta = inner.get("rope_theta") if isinstance(inner, dict) else None
        if theta is not None and theta != out[key]:
            get.problems.append(f"rope_parameters.{block}.rope_theta = {_show(theta)} disagrees with {key} = "
                                f"{_show(out[key])}; give the same value (or leave one out)")
    main = (rope_params or {}).get("main")
    kind = main.get("rope_type", main.get("type")) if isinstance(main, dict) else None
    if kind not in (None, "default"):
        get.problems.append(f"rope_parameters.main.rope_type = {_show(kind)} is not supported: DeepSeek-V4 scales only "
                            f"the compress RoPE (rope_parameters.compress); use 'default'")


def _yarn_block(get: _KeyReader, src: dict, where: str) -> YarnScaling | None:
    """One RoPE scaling object: None for no scaling ("default"), else its YaRN settings, checked."""
    kind = src.get("rope_type", src.get("type", "default"))
    if kind in ("default", None):
        factor = src.get("factor")
        if factor is not None and factor != 1:
            get.problems.append(f"{where}.factor = {_show(factor)} is given without rope_type 'yarn': DeepSeek-V4 "
                                f"scales positions only through YaRN; set rope_type 'yarn' (with "
                                f"original_max_position_embeddings) or remove factor")
        return None
    if kind != "yarn":
        key = "rope_type" if "rope_type" in src else "type"
        get.problems.append(f"{where}.{key} = {_show(kind)} is not supported for DeepSeek-V4; choose 'yarn' "
                            f"or none")
        return None
    if src.get("mscale") or src.get("mscale_all_dim"):
        get.problems.append(f"{where}: YaRN mscale is not used by DeepSeek-V4; remove mscale/mscale_all_dim")
    if src.get("attention_factor") not in (None, 1.0, 1):
        get.problems.append(f"{where}.attention_factor = {_show(src.get('attention_factor'))} is not supported: "
                            f"DeepSeek-V4 uses YaRN with attention_factor 1.0")
    values = {}
    before = len(get.problems)
    for field, rng in YARN_RANGES.items():
        if src.get(field) is None and field in ("factor", "original_max_position_embeddings"):
            get.problems.append(f"{where}.{field} is missing: YaRN needs it ({rng.describe()})")
            continue
        values[field] = get.check(f"{where}.{field}", src.get(field), None, rng=rng)
    if len(get.problems) > before or any(values.get(f) is None for f in ("factor", "original_max_position_embeddings")):
        return None
    return YarnScaling(**{k: v for k, v in values.items() if v is not None})
