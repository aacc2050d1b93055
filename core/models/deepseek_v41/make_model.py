"""Write random-weight DeepSeek-V4.1 checkpoints in the release layout (`deepinfer make-model --family v41`).

The output is what `checkpoint.load_checkpoint` reads and what NeMo AutoModel's V4.1 state-dict
adapter converts with no missing or unexpected key: the composite `config.json`
(`DeepseekV41Config.to_dict()` with the release's `quantization_config`), safetensors shards plus
`model.safetensors.index.json` under the official names, the tokenizer in `tokenizer/`, and
`deepinfer_make_model.json` recording how it was made.

Stored formats (as the release): FP8 e4m3 with one ue8m0 `.scale` per 32x32 block for the dense
projections (`attn.{wq_a,wq_b,wkv,wo_a,wo_b}`, `attn.indexer.wq_b`, shared experts, `engram.wkv`);
packed FP4 routed experts (int8 `[out, in/2]`, one scale per 32 inputs); FP8 Engram tables with one
scale per row and 32 channels; F32 for mHC, sinks and router biases; everything else in the
preset's storage dtype (float32 for `tiny`, bfloat16 otherwise).

Random values follow DeepSeek-V4's make-model (`deepseek_v4.make_model`): linear weights
N(0, 1/in) so activations stay O(1), norms U(0.8, 1.2), sinks, mHC bases and router biases drawn
(not zero) so that no code path is invisible to tests. Each tensor has its own generator seeded by
(seed, name): the same arguments always give the same checkpoint.

Derived sizes: `engram_num_embeddings` is the exact row count the hashing needs (per Engram layer,
the sum of its (N-1) x heads primes, `engram.engram_primes`), and `engram_compressed_vocab_size` is
measured on the written tokenizer (`engram_vocab`), unless given as overrides.

Sizes (`SIZES`): `tiny` (unit tests: vocab 512, hidden 64, 8 layers holding every layer role),
`default` (the embedded default model: the real 129,280-token vocabulary, hidden 64, the release's
schedule scaled to 12 layers), `bench` (hidden 1024, 12 layers, about DeepSeek-V4 `bench`'s cost).
`default` and `bench` include the DSpark drafter (`mtp.0-2`, stored like the release: FP8 attention
projections, `main_proj` and shared experts, FP4 routed experts, fp32 confidence head); tiny only
with `with_dspark=True` (`--dspark`).

With `with_vision=True` (`--vision`) the checkpoint also has an image tower (`VISION[size]`: a
`vision_config` block and the 266-tensor layout of the release at that block's depth, in the
storage dtype with fp32 norms; vision.py): tiny's is 2 layers of width 32 on 4-pixel patches, so a
test image of a few dozen pixels is a handful of positions; default's 2 layers of width 64 with the
release's sizing; bench's the release's tower. No preset has one unless asked, so the text models
(and the baselines keyed on them) stay as they were.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from deepinfer.models.common import quant
from deepinfer.models.common.safetensors_io import DEFAULT_MAX_SHARD_BYTES, _bytes_bar, write_safetensors
from deepinfer.models.deepseek_v4.config import YarnScaling
from deepinfer.models.deepseek_v4.make_model import (
    MARKER_FILE, _generator, _parse_override, _parse_size_bytes, empty_out_dir, initial_value, write_tokenizer,
)
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.engram import engram_primes
from deepinfer.models.deepseek_v41.engram_vocab import compressed_token_map
from deepinfer.models.deepseek_v41.vision import is_vision_norm, is_vision_weight, vision_weight_shapes
from deepinfer.models.deepseek_v41.vision_config import VisionConfig
from deepinfer.models.deepseek_v41.weights import dspark_weight_shapes, expected_weight_shapes, weight_kind
from deepinfer.models.registry import CheckpointMaker
from deepinfer.tokenizer import TOKENIZER_DIR, TOKENIZER_FILE

SPEC_VERSION = 3  # bump when a preset or the initialisation changes (2: the DSpark drafter; 3: <｜System｜>)
FAMILY = "v41"
BLOCK = 32  # FP8 block size of the release
RELEASE_QUANTIZATION: dict[str, Any] = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
    "scale_fmt": "ue8m0", "expert_dtype": "fp4",
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# the release's schedule (ratio-2 layers with a KV source every 6, then ratio-1 layers with one KV
# source and an index source every 4; Engram before layer 1 and before a KV source) at 12 layers
_SCALED_SCHEDULE = dict(
    num_hidden_layers=12, compress_ratios=(0, 0) + (2,) * 5 + (1,) * 5, kv_source_layer_ids=(2, 5, 7),
    index_source_layer_ids=(2, 5, 7, 9, 11), candidate_source_layer_id=7, engram_layer_ids=(1, 5),
    num_nextn_predict_layers=0, dspark_target_layer_ids=())

SIZES: dict[str, dict[str, Any]] = {
    # every role: 0-1 sliding, 2 Full r=2, 3 Reuse r=2, 4 Full r=1 (candidate source), 5 Reuse r=1,
    # 6 Reindex inside the candidate pool, 7 Reuse after Reindex; Engram before a sliding and a Full
    # layer; index_topk 4 so that prompts of a few compressed entries already select.
    "tiny": dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(2, 4), index_source_layer_ids=(2, 4, 6),
        candidate_source_layer_id=4, candidate_block_size=2, candidate_topk_blocks=2,
        index_n_heads=16, index_head_dim=16, index_topk=4,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        rope_scaling=YarnScaling(factor=16, original_max_position_embeddings=32), max_position_embeddings=512,
        engram_layer_ids=(1, 4), engram_head_dim=32, engram_n_heads=2, engram_vocab_size=600,
        num_nextn_predict_layers=0, dspark_target_layer_ids=(), dspark_noise_token_id=511, image_token_id=None,
        dtype="float32"),
    # random weights with the real vocabulary, a few tens of MB, quick on two cores
    "default": dict(
        _SCALED_SCHEDULE, vocab_size=129280, hidden_size=64, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=32,
        candidate_block_size=4, candidate_topk_blocks=4, index_n_heads=16, index_head_dim=16, index_topk=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        rope_scaling=YarnScaling(factor=16, original_max_position_embeddings=4096), max_position_embeddings=65536,
        engram_head_dim=32, engram_n_heads=2, engram_vocab_size=2000, dtype="bfloat16"),
    # the shape of the trained demo model (`deepinfer.models.deepseek_v41.demo_model`): every layer role
    # of tiny at width 256, a window and top-k that matter at its 256-token training context
    "demo": dict(
        vocab_size=129280, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=128, o_groups=2, o_lora_rank=128, sliding_window=64,
        compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(2, 4), index_source_layer_ids=(2, 4, 6),
        candidate_source_layer_id=4, candidate_block_size=4, candidate_topk_blocks=8,
        index_n_heads=8, index_head_dim=32, index_topk=32,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
        rope_scaling=YarnScaling(factor=16, original_max_position_embeddings=4096), max_position_embeddings=65536,
        engram_layer_ids=(1, 4), engram_head_dim=32, engram_n_heads=2, engram_vocab_size=2000,
        num_nextn_predict_layers=0, dspark_target_layer_ids=(), dtype="bfloat16"),
    # about DeepSeek-V4 `bench`'s size and cost, the release's window and top-k
    "bench": dict(
        _SCALED_SCHEDULE, vocab_size=129280, hidden_size=1024, num_attention_heads=16, head_dim=128,
        qk_rope_head_dim=32, q_lora_rank=384, o_groups=4, o_lora_rank=256, sliding_window=128,
        candidate_block_size=8, candidate_topk_blocks=256, index_n_heads=16, index_head_dim=64, index_topk=512,
        n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
        rope_scaling=YarnScaling(factor=16, original_max_position_embeddings=65536),
        max_position_embeddings=1048576, engram_head_dim=256, engram_n_heads=4, engram_vocab_size=20000,
        dtype="bfloat16"),
}
# the DSpark drafter (mtp.0-2) of each preset, written unless with_dspark=False (tiny: only when asked);
# like the release it reads the attention inputs of the last three layers
DSPARK: dict[str, dict[str, Any]] = {
    "tiny": dict(num_nextn_predict_layers=3, dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=8,
                 dspark_n_routed_experts=8, dspark_num_experts_per_tok=3),
    "default": dict(num_nextn_predict_layers=3, dspark_target_layer_ids=(9, 10, 11), dspark_markov_rank=16,
                    dspark_n_routed_experts=8, dspark_num_experts_per_tok=3),
    "demo": dict(num_nextn_predict_layers=3, dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=32,
                 dspark_n_routed_experts=8, dspark_num_experts_per_tok=3),
    "bench": dict(num_nextn_predict_layers=3, dspark_target_layer_ids=(9, 10, 11), dspark_markov_rank=64,
                  dspark_n_routed_experts=16, dspark_num_experts_per_tok=3),
}
_DSPARK_BY_DEFAULT = {"tiny": False, "default": True, "demo": True, "bench": True}
# the image tower of each preset, written only with with_vision=True (`--vision`)
VISION: dict[str, VisionConfig] = {
    "tiny": VisionConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=48,
                         patch_size=4, max_image_tokens=64, min_pixels=576),
    "default": VisionConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128),
    "demo": VisionConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128),
    "bench": VisionConfig(),
}
TINY_IMAGE_TOKEN_ID = 505  # tiny's vocabulary has no 129264; 505 is its <｜image2｜>, as 129264 in the full one
#: the image placeholder as deepseek-recipe's V4.1 chat encoding spells it, and V4's spelling of the same id
#: (NeMo AutoModel's processor spells it <｜deepseek_image｜>; deepinfer keys on the id)
V41_IMAGE_TOKEN = ("<｜image｜>", "<｜image2｜>")
# tiny is split into several shards so that tests cover the index and scales in other shards
_SHARD_BYTES = {"tiny": 256 * 2**10}

_FP8_RE = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|"
                     r"engram\.wkv|main_proj)\.weight$")
_FP4_RE = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_ENGRAM_TABLE_RE = re.compile(r"^layers\.\d+\.engram\.embed\.weight$")


def model_config(size: str = "tiny", with_dspark: bool | None = None, with_vision: bool = False, **overrides: Any
                 ) -> tuple[DeepseekV41Config, torch.dtype]:
    """The config and storage dtype of a preset with `DeepseekV41Config` field overrides (and
    `dtype`: "float32" or "bfloat16"). `with_dspark`: add the preset's DSpark drafter (`DSPARK`; its
    three stages get compress ratio 0); None: the preset's default (not for tiny). `with_vision`:
    add the preset's image tower (`VISION`; tiny's placeholder id is `TINY_IMAGE_TOKEN_ID`).
    `engram_num_embeddings` is derived unless overridden; `engram_compressed_vocab_size` keeps its
    value here (`make_model` measures it on the tokenizer)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    fields = dict(SIZES[size])
    if _DSPARK_BY_DEFAULT[size] if with_dspark is None else with_dspark:
        fields.update(DSPARK[size])
        fields["compress_ratios"] = tuple(fields["compress_ratios"]) + (0,) * fields["num_nextn_predict_layers"]
    if with_vision:
        fields["vision"] = VISION[size]
        if fields.get("image_token_id", 129264) is None:
            fields["image_token_id"] = TINY_IMAGE_TOKEN_ID
    fields.update(overrides)
    if isinstance(fields.get("vision"), dict):
        fields["vision"] = VisionConfig(**fields["vision"])
    dtype_name = str(fields.pop("dtype"))
    if dtype_name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype_name!r}; choose from {', '.join(_DTYPES)}")
    if isinstance(fields.get("rope_scaling"), dict):
        fields["rope_scaling"] = YarnScaling(**fields["rope_scaling"])
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    derive_rows = "engram_num_embeddings" not in overrides
    if derive_rows:
        fields["engram_num_embeddings"] = (1,) * len(fields.get("engram_layer_ids", ()))
    try:
        config = DeepseekV41Config(**fields)
        if derive_rows:
            config = DeepseekV41Config(**{**fields, "engram_num_embeddings": engram_rows(config)})
    except Exception as e:  # pydantic's message names the field; add the valid keys for typos
        raise ValueError(f"invalid make-model settings for size {size!r}: {e}\nvalid keys: "
                         f"{', '.join(sorted(DeepseekV41Config.model_fields))}, dtype") from None
    return config, _DTYPES[dtype_name]


def engram_rows(config: DeepseekV41Config) -> tuple[int, ...]:
    """Per Engram layer, the table rows its hash buckets need: the sum of its primes."""
    return tuple(sum(primes) for primes in engram_primes(config))


def count_parameters(config: DeepseekV41Config) -> int:
    """Backbone and DSpark drafter parameters."""
    return sum(math.prod(s) for s in all_weight_shapes(config).values())


def all_weight_shapes(config: DeepseekV41Config) -> dict[str, tuple[int, ...]]:
    vision = {} if config.vision is None else vision_weight_shapes(config.vision, config.hidden_size)
    return expected_weight_shapes(config) | dspark_weight_shapes(config) | vision


# --- random values ---------------------------------------------------------------------------

def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A random fp32 value for one official tensor: DeepSeek-V4's rules (`initial_value`), plus
    Engram's q/k weights U(0.8, 1.2) (norm-like), its tables N(0, 1) (embedding-like) and the
    vision-token router bias N(0, 0.1^2)."""
    g = _generator(seed, name)
    if name.endswith(("engram.q_weight", "engram.k_weight")):
        return 0.8 + 0.4 * torch.rand(shape, generator=g)
    if _ENGRAM_TABLE_RE.match(name):
        return torch.randn(shape, generator=g)
    if name.endswith("gate.bias_vl"):
        return torch.randn(shape, generator=g) * 0.1
    if is_vision_weight(name):  # norms U(0.8, 1.2), biases N(0, 0.1^2), delimiters N(0, 1)
        if is_vision_norm(name):
            return 0.8 + 0.4 * torch.rand(shape, generator=g)
        if name.endswith(".bias"):
            return torch.randn(shape, generator=g) * 0.1
        if len(shape) == 1:
            return torch.randn(shape, generator=g)
    return initial_value(name, shape, g)


def release_tensors(config: DeepseekV41Config, seed: int, dtype: torch.dtype, progress: bool = False
                    ) -> dict[str, torch.Tensor]:
    """Every stored tensor of the release layout, random and quantised (see the module docstring)."""
    shapes = {k: v for k, v in all_weight_shapes(config).items() if not k.endswith(".engram.embed.scale")}
    out: dict[str, torch.Tensor] = {}
    bar = _bytes_bar(sum(math.prod(s) for s in shapes.values()) * 4, "generating weights", progress)
    for name, shape in shapes.items():
        out |= release_format(name, random_tensor(name, shape, seed), dtype)
        bar.update(math.prod(shape) * 4)
    bar.close()
    return out


def release_format(name: str, value: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One official tensor as the release stores it: experts FP4, dense projections FP8 (each with
    its `.scale`), Engram tables FP8 rows, float32 kinds in float32, the rest in `dtype`."""
    base = name.removesuffix(".weight")
    if _FP4_RE.match(name):
        weight, scale = quant.quantize_fp4(value)
    elif _FP8_RE.match(name):
        weight, scale = quant.quantize_fp8_block(value, BLOCK)
    elif _ENGRAM_TABLE_RE.match(name):
        weight, scale = quant.quantize_fp8_rows(value)
    else:
        return {name: value.to(torch.float32 if weight_kind(name) == "fp32" else dtype)}
    return {name: weight, base + ".scale": scale}


# --- writing ---------------------------------------------------------------------------------

def make_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, overwrite: bool = False,
               max_shard_bytes: int | None = None, progress: bool | None = None, with_dspark: bool | None = None,
               with_vision: bool = False, **overrides: Any) -> Path:
    """Write a random-weight DeepSeek-V4.1 checkpoint in the release layout to `out_dir`; its path.

    Args:
        size: a preset from `SIZES` ("tiny", "default", "demo", "bench").
        seed: random seed; the same arguments always give the same files.
        overwrite: replace an existing non-empty `out_dir`.
        max_shard_bytes: shard size (default: 256 KiB for tiny, so it has several shards; else 1 GiB).
        progress: show progress bars (None: only for checkpoints over 100 MB).
        with_dspark: write the DSpark drafter (`mtp.0-2`, the preset's `DSPARK` settings); None: the
            preset's default (default and bench: yes, tiny: no).
        with_vision: write the preset's image tower (`VISION`) and its `vision_config`.
        **overrides: `DeepseekV41Config` fields and `dtype` (see `model_config`).
    Raises ValueError for unknown sizes or invalid settings (a model with Engram layers needs a
    vocabulary that holds at least the cut-down tokenizer) and FileExistsError for a non-empty
    `out_dir` without `overwrite`.
    """
    out = empty_out_dir(out_dir, overwrite)
    config, dtype = model_config(size, with_dspark, with_vision, **overrides)
    n_params = count_parameters(config)
    if progress is None:
        progress = n_params * dtype.itemsize > 100 * 2**20
    if not write_release_tokenizer(out, config):
        shutil.rmtree(out)
        raise ValueError(f"vocab_size {config.vocab_size} is too small for a tokenizer, which the Engram layers "
                         f"need; use a larger vocab_size")
    if "engram_compressed_vocab_size" not in overrides:
        _, compressed = compressed_token_map(out / TOKENIZER_DIR / TOKENIZER_FILE)
        config = config.model_copy(update={"engram_compressed_vocab_size": compressed})
    config = config.model_copy(update={"quantization_config": dict(RELEASE_QUANTIZATION),
                                       "expert_dtype": RELEASE_QUANTIZATION["expert_dtype"]})

    tensors = release_tensors(config, seed, dtype, progress)
    shard_bytes = max_shard_bytes or _SHARD_BYTES.get(size, DEFAULT_MAX_SHARD_BYTES)
    write_safetensors(tensors, out, shard_bytes, progress)
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    marker = {"made_by": "deepinfer make-model", "family": FAMILY, "spec_version": SPEC_VERSION, "size": size,
              "seed": seed, "parameters": n_params, "dspark": config.num_nextn_predict_layers > 0,
              **({"vision": True} if config.vision is not None else {}),
              "overrides": {k: (list(v) if isinstance(v, tuple) else v) for k, v in overrides.items()
                            if not isinstance(v, YarnScaling)}}
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2, default=str))
    return out


def write_release_tokenizer(out: Path, config: DeepseekV41Config) -> bool:
    """`tokenizer/tokenizer.json` for `config` (the V4.1 chat tokens, the image token's spelling);
    False when the vocabulary is too small for a tokenizer."""
    (out / TOKENIZER_DIR).mkdir(parents=True, exist_ok=True)
    if not write_tokenizer(out / TOKENIZER_DIR, config.vocab_size):
        return False
    add_release_chat_tokens(out / TOKENIZER_DIR / TOKENIZER_FILE)
    if config.vision is not None:
        rename_image_token(out / TOKENIZER_DIR / TOKENIZER_FILE, config.image_token_id)
    return True


#: V4.1 chat tokens missing from the V4 tokenizer -> the unused V4 special token whose id each takes
V41_CHAT_TOKENS = {"<｜System｜>": "<｜fim▁hole｜>"}


def add_release_chat_tokens(tokenizer_file: Path) -> None:
    """Give the tokenizer the special tokens V4.1's chat format adds to V4's: `<｜System｜>`.

    make-model starts from the DeepSeek-V4 tokenizer (the one installed here); V4.1's release
    tokenizer also has `<｜System｜>`, without which its chat encoding cannot render a conversation.
    The token takes the id of V4's `<｜fim▁hole｜>`, which V4.1's chat format does not use (a
    random-weight model has no trained embedding to lose); a real checkpoint brings its own tokenizer."""
    data = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    contents = {t["content"] for t in data["added_tokens"]}
    for token, replaced in V41_CHAT_TOKENS.items():
        if token in contents:
            continue
        (entry,) = [t for t in data["added_tokens"] if t["content"] == replaced]
        entry["content"] = token
    tokenizer_file.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def rename_image_token(tokenizer_file: Path, image_token_id: int) -> None:
    """Spell the image placeholder as V4.1's chat encoding does (`<｜image｜>`, V4's `<｜image2｜>`), at
    `image_token_id`. ValueError when that id is not V4's image token."""
    data = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    new, old = V41_IMAGE_TOKEN
    entries = [t for t in data["added_tokens"] if t["id"] == image_token_id and t["content"] in (old, new)]
    if not entries:
        raise ValueError(f"image_token_id {image_token_id} is not the tokenizer's {old} token; leave image_token_id "
                         f"at the preset's value")
    entries[0]["content"] = new
    tokenizer_file.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


# --- command line ----------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """DeepSeek-V4.1's own `deepinfer make-model` flags (OUT_DIR, --family, --size, --seed and
    --force are the command's); their values reach `make_checkpoint` by `dest`."""
    parser.add_argument("--dtype", choices=list(_DTYPES), default=None, help="storage dtype of unquantised weights")
    parser.add_argument("--set", dest="overrides", action="append", type=_parse_override, default=[],
                        metavar="KEY=VALUE", help="override a config field (JSON value), e.g. --set sliding_window=16")
    parser.add_argument("--dspark", dest="with_dspark", action=argparse.BooleanOptionalAction, default=None,
                        help="write the DSpark drafter mtp.0-2 (default: yes for default and bench, no for tiny)")
    parser.add_argument("--vision", dest="with_vision", action="store_true",
                        help="also write an image tower (vision_config and vision.*/aligner.*/image_* tensors)")
    parser.add_argument("--max-shard-size", type=_parse_size_bytes, default=None,
                        help="split the weights into shards of at most this size (default 1GiB; tiny 256KiB)")


def make_checkpoint(out_dir: str | Path, size: str = "tiny", seed: int = 0, overwrite: bool = False, *,
                    dtype: str | None = None, overrides: list[tuple[str, Any]] | None = None,
                    max_shard_size: int | None = None, with_dspark: bool | None = None,
                    with_vision: bool = False) -> str:
    """`deepinfer make-model --family v41`: `make_model` with the command's flags; returns the
    summary line the command prints."""
    fields = dict(overrides or [])
    if dtype:
        fields["dtype"] = dtype
    out = make_model(out_dir, size=size, seed=seed, overwrite=overwrite, max_shard_bytes=max_shard_size,
                     with_dspark=with_dspark, with_vision=with_vision, **fields)
    marker = json.loads((out / MARKER_FILE).read_text())
    disk = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return (f"wrote {out}: DeepSeek-V4.1 {size}, {marker['parameters']:,} parameters, {disk / 2**20:.1f} MiB of "
            f"weights (FP8/FP4 release format)")


#: the family's `ModelFamily.make_checkpoint` (`deepinfer make-model --family v41`)
CHECKPOINT_MAKER = CheckpointMaker(make=make_checkpoint, sizes=tuple(SIZES), add_arguments=add_arguments)
