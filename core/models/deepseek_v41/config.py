"""DeepSeek-V4.1 hyperparameters and the per-layer role tables derived from them.

The released `config.json` is composite: `model_type: deepseek_v41` with `text_config` (the
language model, below), `vision_config` and `quantization_config` blocks, plus top-level token ids
(`bos_token_id`, `eos_token_id`, `pad_token_id`, `image_token_id`). `DeepseekV41Config.from_dict`
accepts that form and a flat text config (the `text_config` block on its own, `model_type:
deepseek_v41_text`); a problem names the key as spelt in the file (`text_config.hidden_size`).

Layer roles (CSA2): a layer with compress ratio 0 is sliding-window only. A compressed layer is
*Full* when it is a KV source (`kv_source_layer_ids`: it owns a compressor, the index-key
projection and an indexer), *Reindex* when it is an index source but no KV source (its own indexer
query rescores the KV source's index keys), and *Reuse* otherwise (it reads the latest KV source's
compressed KV and the latest index source's top-k and owns neither). Every compressed layer's KV
source is the latest one at or before it, with the same ratio.
"""
from __future__ import annotations

from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from deepinfer.models.common.config_values import (
    MAX_COMPRESS_RATE, MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, Range, quantization_problems, range_problems, report,
    show_value, tied_embeddings_problem, token_ids_problem, type_name,
)
from deepinfer.models.common.errors import CheckpointError
from deepinfer.models.deepseek_v4.config import FIELD_RANGES as V4_FIELD_RANGES
from deepinfer.models.deepseek_v4.config import YarnScaling
from deepinfer.models.deepseek_v41.vision_config import (
    VISION_MODEL_TYPE, VisionConfig, parse_vision_config, vision_config_problems,
)

MODEL_TYPE = "deepseek_v41"
TEXT_MODEL_TYPE = "deepseek_v41_text"
SLIDING, FULL, REINDEX, REUSE = "sliding", "full", "reindex", "reuse"

MAX_ENGRAM_ROWS = 1 << 40  # rows of one memory-mapped Engram table (the release's: 3.8e8)

#: V4's range for each field the two families share, then V4.1's own fields (and the two that differ)
FIELD_RANGES: dict[str, Range] = {
    **{name: V4_FIELD_RANGES[name] for name in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
        "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
        "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor", "swiglu_limit",
        "rope_theta", "compress_rope_theta", "max_position_embeddings", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
        "num_nextn_predict_layers")},
    "candidate_source_layer_id": Range(int, -1, MAX_LAYERS),
    "candidate_topk_blocks": Range(int, 1, MAX_POSITIONS),
    "candidate_block_size": Range(int, 1, MAX_POSITIONS),
    "n_shared_experts": Range(int, 1, 1),
    "gate_temp": Range(float, 0, open_low=True),
    "rms_norm_eps": Range(float, 0, open_low=True),
    "engram_max_ngram_size": Range(int, 2, 16),
    "engram_vocab_size": Range(int, 2, MAX_ENGRAM_ROWS),
    "engram_n_heads": Range(int, 1, MAX_HEADS),
    "engram_head_dim": Range(int, 1, MAX_HEAD_DIM),
    "engram_pad_token_id": Range(int, 0, MAX_VOCAB),
    "engram_compressed_vocab_size": Range(int, 1, MAX_VOCAB),
    "dspark_block_size": Range(int, 0, 64),
    "dspark_noise_token_id": Range(int, 0, MAX_VOCAB),
    "dspark_markov_rank": Range(int, 1, MAX_WIDTH),
    "dspark_n_routed_experts": Range(int, 1, MAX_EXPERTS),
    "dspark_num_experts_per_tok": Range(int, 1, MAX_HEADS),
}
#: settings a composite config.json holds at its top level, not in text_config
_TOP_LEVEL_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "quantization_config",
                   "expert_dtype")
_LIST_FIELDS = ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                "engram_num_embeddings", "dspark_target_layer_ids")


class DeepseekV41Config(BaseModel):
    """The text model's settings (HF `text_config` names; defaults are the released Flash values)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    # CSA2: one ratio per layer (backbone layers first; entries past num_hidden_layers are DSpark's)
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer_id: int = 20  # -1: no two-level candidate pool
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    # MoE (every layer scored; no hash routing)
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    gate_temp: float = 1.0
    swiglu_limit: float = 10.0
    # RoPE: ratio-0 layers use rope_theta unscaled; compressed layers compress_rope_theta + YaRN
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = YarnScaling(factor=16, original_max_position_embeddings=65536)
    max_position_embeddings: int = 1048576
    # single-pass mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    # Engram n-gram memory before the attention of these layers
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # DSpark drafter (mtp.*): parsed and checked, run by the speculative-decoding plugin
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # token ids (top level of the composite config)
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    pad_token_id: int | None = 2
    image_token_id: int | None = 129264
    # checkpoint storage details, passed through for the loader
    quantization_config: dict[str, Any] | None = None
    expert_dtype: str | None = None
    # the image tower and sizing (the composite's `vision_config`); None: a text-only model
    vision: VisionConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_values(cls, data: Any) -> Any:
        if isinstance(data, dict):
            problems = range_problems(data, FIELD_RANGES)
            for key in _LIST_FIELDS:
                value = data.get(key)
                if value is not None and not (isinstance(value, (list, tuple)) and all(
                        isinstance(v, int) and not isinstance(v, bool) for v in value)):
                    problems.append(f"{key} = {show_value(value)} has the wrong type ({type_name(value)}): must be "
                                    f"a list of integers")
            if not isinstance(data.get("quantization_config"), (dict, type(None))):
                problems += quantization_problems(data["quantization_config"])
            if problems:
                raise ValueError("\n".join(problems))
        return data

    @model_validator(mode="after")
    def _check(self) -> DeepseekV41Config:
        problems = self._cross_field_problems()
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _cross_field_problems(self) -> list[str]:
        p: list[str] = []
        L, ratios, n_draft = self.num_hidden_layers, self.compress_ratios, self.num_nextn_predict_layers
        if len(ratios) not in (L, L + n_draft):
            p.append(f"compress_ratios has {len(ratios)} entries: give one per layer, num_hidden_layers = {L} "
                     f"(optionally followed by one 0 per DSpark stage, num_nextn_predict_layers = {n_draft})")
            return p
        if any(not 0 <= r <= MAX_COMPRESS_RATE for r in ratios):
            p.append(f"compress_ratios = {show_value(list(ratios))} must hold integers in [0, {MAX_COMPRESS_RATE}]")
            return p
        if any(ratios[L:]):
            p.append(f"compress_ratios = {show_value(list(ratios))} is not valid: the entries of the DSpark stages "
                     f"(after the first {L}) must be 0 (sliding-only), got {list(ratios[L:])}")
        for key, ids in (("kv_source_layer_ids", self.kv_source_layer_ids),
                         ("index_source_layer_ids", self.index_source_layer_ids),
                         ("engram_layer_ids", self.engram_layer_ids)):
            if list(ids) != sorted(set(ids)) or any(not 0 <= i < L for i in ids):
                p.append(f"{key} = {list(ids)} must be strictly increasing layer ids in [0, {L})")
        if not set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids):
            p.append(f"kv_source_layer_ids = {list(self.kv_source_layer_ids)} must all be in index_source_layer_ids "
                     f"= {list(self.index_source_layer_ids)} (a KV source runs its own indexer)")
        source_ratio = None
        for i in range(L):
            r = ratios[i]
            if r == 0:
                if i in self.kv_source_layer_ids or i in self.index_source_layer_ids:
                    p.append(f"layer {i} has compress ratio 0 (sliding only) and cannot be a KV or index source")
                continue
            if i in self.kv_source_layer_ids:
                source_ratio = r
            if source_ratio != r:
                p.append(f"compressed layer {i} (ratio {r}) has no KV source with the same ratio at or before it; "
                         f"add one to kv_source_layer_ids")
        c = self.candidate_source_layer_id
        if c >= 0 and c not in self.kv_source_layer_ids:
            p.append(f"candidate_source_layer_id = {c} must be a KV source (kv_source_layer_ids), or -1 for none")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            p.append(f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries but engram_layer_ids has "
                     f"{len(self.engram_layer_ids)}; give one table size per Engram layer")
        if any(not 1 <= n <= MAX_ENGRAM_ROWS for n in self.engram_num_embeddings):
            p.append(f"engram_num_embeddings = {show_value(list(self.engram_num_embeddings))} must hold row counts in "
                     f"[1, {MAX_ENGRAM_ROWS}]")
        if self.engram_layer_ids and self.engram_head_dim % 32:
            p.append(f"engram_head_dim = {self.engram_head_dim} must be a multiple of 32 (the Engram tables keep "
                     f"one scale per 32 channels)")
        d, r, di = self.head_dim, self.qk_rope_head_dim, self.index_head_dim
        if r % 2 or r > min(d, di):
            p.append(f"qk_rope_head_dim = {r} must be even and <= head_dim ({d}) and index_head_dim ({di})")
        if (self.num_attention_heads * d) % self.o_groups:
            p.append(f"o_groups = {self.o_groups} must divide num_attention_heads * head_dim")
        if self.num_experts_per_tok > self.n_routed_experts:
            p.append(f"num_experts_per_tok = {self.num_experts_per_tok} must be <= n_routed_experts "
                     f"= {self.n_routed_experts}")
        if self.scoring_func != "sqrtsoftplus":
            p.append(f"scoring_func = {self.scoring_func!r} is not supported by DeepSeek-V4.1; use 'sqrtsoftplus'")
        for key, value in (("bos_token_id", self.bos_token_id), ("eos_token_id", self.eos_token_id),
                           ("engram_pad_token_id", self.engram_pad_token_id)):
            if (problem := token_ids_problem(key, value, self.vocab_size)) is not None:
                p.append(problem)
        if self.vision is not None and self.image_token_id is None:
            p.append("image_token_id is null but vision_config has a vision tower: give the id of the image "
                     "placeholder token (129264 in the release)")
        elif self.vision is not None and (problem := token_ids_problem("image_token_id", self.image_token_id,
                                                                         self.vocab_size)) is not None:
            p.append(problem)
        p += quantization_problems(self.quantization_config)
        return p + self._dspark_problems()

    def _dspark_problems(self) -> list[str]:
        """The DSpark drafter's settings, checked only when it has stages."""
        if not self.num_nextn_predict_layers:
            return []
        p: list[str] = []
        ids, L = list(self.dspark_target_layer_ids), self.num_hidden_layers
        if not ids or ids != sorted(set(ids)) or any(not 0 <= i < L for i in ids):
            p.append(f"dspark_target_layer_ids = {ids} must be strictly increasing layer ids in [0, {L}) (the DSpark "
                     f"drafter reads the attention inputs of these layers); give at least one, or set "
                     f"num_nextn_predict_layers = 0")
        if self.dspark_block_size < 1:
            p.append(f"dspark_block_size = {self.dspark_block_size} must be >= 1")
        if not 0 <= self.dspark_noise_token_id < self.vocab_size:
            p.append(f"dspark_noise_token_id = {self.dspark_noise_token_id} is out of range: token ids must be in "
                     f"[0, {self.vocab_size})")
        if self.dspark_num_experts_per_tok > self.dspark_n_routed_experts:
            p.append(f"dspark_num_experts_per_tok = {self.dspark_num_experts_per_tok} must be <= "
                     f"dspark_n_routed_experts = {self.dspark_n_routed_experts}")
        return p

    # ----- derived role tables -----
    def compress_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    @cached_property
    def layer_roles(self) -> tuple[str, ...]:
        """sliding / full / reindex / reuse, per backbone layer."""
        out = []
        for i in range(self.num_hidden_layers):
            if self.compress_ratios[i] == 0:
                out.append(SLIDING)
            elif i in self.kv_source_layer_ids:
                out.append(FULL)
            elif i in self.index_source_layer_ids:
                out.append(REINDEX)
            else:
                out.append(REUSE)
        return tuple(out)

    @cached_property
    def kv_owner(self) -> dict[int, int]:
        """Compressed layer -> the KV source whose compressed KV and index keys it reads."""
        return self._latest_source(self.kv_source_layer_ids)

    @cached_property
    def topk_owner(self) -> dict[int, int]:
        """Compressed layer -> the index source whose top-k selection it attends over."""
        return self._latest_source(self.index_source_layer_ids)

    def _latest_source(self, sources) -> dict[int, int]:
        """Compressed layer -> the latest layer of `sources` at or before it."""
        owner, out = None, {}
        for i in range(self.num_hidden_layers):
            if self.compress_ratios[i]:
                owner = i if i in sources else owner
                out[i] = owner
        return out

    def uses_candidates(self, layer: int) -> bool:
        """An index source after the candidate source scores only inside its candidate pool."""
        c = self.candidate_source_layer_id
        return layer in self.index_source_layer_ids and 0 <= c < layer

    @property
    def engram_hash_heads(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    # ----- parsing -----
    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> DeepseekV41Config:
        """Parse the composite release config (or a flat text config); every problem in one
        CheckpointError naming the key as spelt in the file."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source} must hold a JSON object with the model's settings (got {type_name(d)})")
        model_type = d.get("model_type")
        if model_type == MODEL_TYPE:
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise CheckpointError(f"{source}: text_config must be an object holding the language model's "
                                      f"settings (got {type_name(text)}); a deepseek_v41 config.json is composite")
            prefix, top = "text_config.", d
        elif model_type == TEXT_MODEL_TYPE:
            text, prefix, top = d, "", d
        else:
            raise CheckpointError(f"{source}: model_type {model_type!r} is not a DeepSeek-V4.1 config "
                                  f"({MODEL_TYPE!r}, or {TEXT_MODEL_TYPE!r} for a text config)")
        fields = {k: v for k, v in text.items() if k in cls.model_fields}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
            if key in top and key in cls.model_fields:
                fields[key] = top[key]
        if isinstance(fields.get("eos_token_id"), list):
            fields["eos_token_id"] = tuple(fields["eos_token_id"])
        rope = fields.pop("rope_scaling", cls.model_fields["rope_scaling"].default)
        problems = []
        for where, block in ((prefix, text), ("", top)):
            if (p := tied_embeddings_problem(f"{where}tie_word_embeddings", block.get("tie_word_embeddings"))):
                problems.append(p)
        vision = top.get("vision_config")
        problems += vision_config_problems(vision)
        if not problems:
            fields["vision"] = parse_vision_config(vision)
        if isinstance(rope, dict):
            kind_key = "rope_type" if "rope_type" in rope else "type"
            if rope.get(kind_key, "yarn") != "yarn":
                problems.append(f"{prefix}rope_scaling.{kind_key} = {rope.get(kind_key)!r} is not supported; "
                                f"DeepSeek-V4.1 uses 'yarn'")
            else:
                keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
                try:
                    rope = YarnScaling(**{k: rope[k] for k in keys if k in rope})
                except ValidationError as err:
                    problems += [f"{prefix}rope_scaling.{line}" for e in err.errors()
                                 for line in str(e["msg"]).removeprefix("Value error, ").split("\n")]
        fields["rope_scaling"] = rope
        q = top.get("quantization_config")
        if q is not None:  # checked with the other values (quantization_problems)
            fields["quantization_config"] = q
            fields["expert_dtype"] = q.get("expert_dtype") if isinstance(q, dict) else None
        for key in _LIST_FIELDS:
            if isinstance(fields.get(key), list):
                fields[key] = tuple(fields[key])
        if not problems:
            try:
                return cls(**fields)
            except ValidationError as err:
                for e in err.errors():
                    for line in str(e["msg"]).removeprefix("Value error, ").split("\n"):
                        loc = ".".join(str(x) for x in e["loc"])
                        where = "" if line.startswith(_TOP_LEVEL_KEYS) else prefix  # keys of the composite's top
                        problems.append(f"{where}{line}" if not loc else f"{prefix}{loc}: {line}")
        raise CheckpointError(report(source, problems))

    def to_dict(self) -> dict[str, Any]:
        """The composite release config.json (what `make-model --family v41` writes)."""
        text = self.model_dump(exclude={"bos_token_id", "eos_token_id", "pad_token_id", "image_token_id",
                                        "quantization_config", "expert_dtype", "rope_scaling", "vision"})
        text = {k: list(v) if isinstance(v, tuple) else v for k, v in text.items()}
        text["model_type"] = TEXT_MODEL_TYPE
        if self.rope_scaling is not None:
            text["rope_scaling"] = {"rope_type": "yarn", **self.rope_scaling.model_dump()}
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        out = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": MODEL_TYPE, "dtype": "bfloat16",
               "bos_token_id": self.bos_token_id, "eos_token_id": eos, "pad_token_id": self.pad_token_id,
               "image_token_id": self.image_token_id, "text_config": text,
               "vision_config": ({"model_type": VISION_MODEL_TYPE, "num_hidden_layers": 0} if self.vision is None
                                 else self.vision.to_dict())}
        if self.quantization_config is not None:
            out["quantization_config"] = dict(self.quantization_config)
        return out
