"""Load a DeepSeek-V4.1 checkpoint folder into canonical (official-name) tensors.

The release layout: a composite `config.json` (`model_type: deepseek_v41`, `text_config`,
`quantization_config`), safetensors shards listed in `model.safetensors.index.json` (a single
`model.safetensors` also loads), and the tokenizer in `tokenizer/tokenizer.json` (a root
`tokenizer.json` also works). Other files, `encoding/encoding.py` among them, are never read, let
alone imported or run.

Stored formats (`quantization_config`): dense projections FP8 e4m3 with one ue8m0 `.scale` per
`weight_block_size` block (32x32 in the release; 32 when the key is absent); routed experts packed
FP4 (int8 `[out, in/2]`, one scale per 32 inputs); the Engram tables FP8 `[rows, engram_head_dim]`
with one scale per row and 32 channels; the rest BF16 or F32. Quantised weights are dequantised on
load (fp32, exact, then rounded once to `dtype`; `weights.weight_kind` "fp32" tensors stay
float32) unless the back end declares their format (`weight_formats`: then the linear weights stay
`QuantizedWeight`s), except the Engram tables and their scales: those are returned exactly as stored
(float8_e4m3fn / float8_e8m0fnu) and memory-mapped from the shard file (the release's are about
200 GB), so they take no RAM until rows are read, and the memory check leaves them out.

The image tower's `vision.*`, `aligner.*` and `image_{start,end,newline}` tensors are loaded (checked
against `vision.vision_weight_shapes`; norms in fp32, the rest in `dtype`) when config.json has a
`vision_config` with layers and the checkpoint holds them; otherwise they are left out (logged; a
config with a tower and no tower tensors loads the text model, with a warning). The DSpark drafter's `mtp.*` tensors are loaded (dequantised, checked against
`weights.dspark_weight_shapes`) when `text_config.num_nextn_predict_layers` > 0 and the checkpoint
holds them; otherwise they are left out too.

Everything is checked before tensor data is read, each problem a `CheckpointError` (the shared
checks of `deepinfer.models.common.checkpoint`: file layouts, shard index, one error listing every
missing, unexpected, mis-shaped, wrongly typed or badly quantised tensor; then the RAM available,
`CheckpointTooLargeError`). A model with Engram layers also needs the checkpoint's own tokenizer:
its compressed vocabulary (`engram_vocab.compressed_token_map`) must have exactly
`text_config.engram_compressed_vocab_size` ids, and it is returned as the derived tensor
`engram.token_map` (int64 `[vocab_size]`, token id -> compressed id).
"""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch

from deepinfer.models.common import checkpoint as _common
from deepinfer.models.common.checkpoint import SafetensorsCheckpoint
from deepinfer.models.common.config_values import fp8_block_size, quantization_problems, report
from deepinfer.models.common.config_values import type_name as _kind
from deepinfer.models.common.errors import CheckpointError
from deepinfer.models.common.safetensors_io import CONFIG_FILE
from deepinfer.models.deepseek_v41.config import MODEL_TYPE, TEXT_MODEL_TYPE, DeepseekV41Config
from deepinfer.models.deepseek_v41.engram_vocab import compressed_token_map
from deepinfer.models.deepseek_v41.vision import is_vision_weight, vision_weight_shapes
from deepinfer.models.deepseek_v41.weights import (
    DSPARK_PREFIX, SKIPPED_PREFIXES, canonicalize, dspark_weight_shapes, expected_weight_shapes, is_engram_table,
    is_quantizable, is_skipped, weight_kind,
)
from deepinfer.tokenizer import checkpoint_tokenizer_file

logger = logging.getLogger(__name__)

TOKEN_MAP = "engram.token_map"
RELEASE_BLOCK_SIZE = 32  # FP8 block size when quantization_config has no weight_block_size
SUPPORTED_MODEL_TYPES = (MODEL_TYPE, TEXT_MODEL_TYPE)
DTYPE_REFERENCE_NAMES = ("embed.weight", "model.embed_tokens.weight")
# checked for NaN / infinity entirely at load, whatever their size (the others: see common/finite.py)
FINITE_WHOLE = ("embed.weight",)
_ENGRAM_DTYPES = {"weight": torch.float8_e4m3fn, "scale": torch.float8_e8m0fnu}
_SMALLER = "a smaller checkpoint (e.g. one written by `deepinfer make-model --family v41`)"


def parse_config(config_dict: dict, source: str = CONFIG_FILE) -> DeepseekV41Config:
    """`DeepseekV41Config` from a config dict (composite release config, or a flat text config).
    Every value is type- and range-checked; a problem is a CheckpointError naming the key as spelt
    in the file (`text_config.hidden_size`, `quantization_config.weight_block_size`)."""
    if not isinstance(config_dict, dict):
        raise CheckpointError(f"{source} must hold a JSON object with the model's settings (got "
                              f"{_kind(config_dict)})")
    model_type = config_dict.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{source}: model_type {model_type!r} is not supported here; supported model types: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    config = DeepseekV41Config.from_dict(config_dict, source)
    block_size(config, source)
    return config


def block_size(config: DeepseekV41Config, source: str = CONFIG_FILE) -> int:
    """Rows and columns per FP8 scale block: `quantization_config.weight_block_size` ([b, b]), or
    32 (the release's) when absent. CheckpointError for any other form."""
    size = fp8_block_size(config.quantization_config, RELEASE_BLOCK_SIZE)
    if size is None:
        raise CheckpointError(report(source, quantization_problems(config.quantization_config)))
    return size


def target_dtype(official_name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype one loaded tensor is kept in (`weights.weight_kind`)."""
    kind = weight_kind(official_name)
    if kind == "quantized":
        return _ENGRAM_DTYPES[official_name.rsplit(".", 1)[-1]]
    return torch.float32 if kind == "fp32" else dtype


def engram_token_map(root: Path, config: DeepseekV41Config) -> torch.Tensor:
    """`engram.token_map` (int64 `[vocab_size]`) from the checkpoint's own tokenizer.

    Token ids the tokenizer does not have (a vocabulary padded past it) map to the compressed id of
    `engram_pad_token_id`. CheckpointError when there is no tokenizer, when it has more ids than
    `vocab_size`, or when its compressed vocabulary is not `engram_compressed_vocab_size` ids.
    """
    path = checkpoint_tokenizer_file(root)
    if path is None:
        raise CheckpointError(
            f"checkpoint {root} has Engram layers (text_config.engram_layer_ids = {list(config.engram_layer_ids)}) "
            f"but no tokenizer: Engram hashes the checkpoint's own tokenizer's compressed vocabulary. Put its "
            f"tokenizer.json in {root / 'tokenizer'} (or at the folder's root).")
    try:
        token_map, size = compressed_token_map(path)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {root}: {e}") from None
    V = config.vocab_size
    if len(token_map) > V:
        raise CheckpointError(f"{path} has {len(token_map)} token ids, more than text_config.vocab_size = {V}; "
                              f"use the tokenizer that belongs to this checkpoint")
    if size != config.engram_compressed_vocab_size:
        raise CheckpointError(
            f"{path} gives {size} compressed Engram ids but text_config.engram_compressed_vocab_size = "
            f"{config.engram_compressed_vocab_size}: the Engram hashes depend on this size, so the tokenizer must "
            f"be the checkpoint's own (put the checkpoint's tokenizer.json in {root / 'tokenizer'})")
    if config.engram_pad_token_id >= len(token_map):
        raise CheckpointError(f"text_config.engram_pad_token_id = {config.engram_pad_token_id} is not a token of "
                              f"{path} ({len(token_map)} ids)")
    pad = token_map[config.engram_pad_token_id]
    return torch.tensor(token_map + [pad] * (V - len(token_map)), dtype=torch.int64)


def _with_dspark(ckpt: SafetensorsCheckpoint, root: Path, config: DeepseekV41Config) -> bool:
    """Whether to load the DSpark drafter: the config has stages and the checkpoint holds `mtp.*`
    tensors (a checkpoint without them loads the backbone only, with a warning; speculative
    decoding is then refused by the dspark feature)."""
    if not config.num_nextn_predict_layers:
        return False
    if any(name.removeprefix("model.").startswith(DSPARK_PREFIX) for name in ckpt.entries):
        return True
    logger.warning("checkpoint %s has no DSpark drafter (mtp.*) weights although config.json sets "
                   "num_nextn_predict_layers = %d; speculative decoding will not be available",
                   root, config.num_nextn_predict_layers)
    return False


def has_dspark_drafter(path: str | Path) -> bool:
    """Whether the checkpoint folder brings a DSpark drafter the engine can run: its config sets
    `num_nextn_predict_layers > 0` and its safetensors hold `mtp.*` tensors (headers only: no
    tensor data is read). Raises like `load_checkpoint` on a missing or invalid folder."""
    root, config = _common.checkpoint_config(path, None, parse_config)
    if not config.num_nextn_predict_layers:
        return False
    entries = SafetensorsCheckpoint(root, block_size=block_size(config)).entries
    return any(name.removeprefix("model.").startswith(DSPARK_PREFIX) for name in entries)


def _with_vision(ckpt: SafetensorsCheckpoint, root: Path, config: DeepseekV41Config) -> bool:
    """Whether to load the image tower: the config has one and the checkpoint holds its tensors."""
    if config.vision is None:
        return False
    if any(is_vision_weight(name.removeprefix("model.")) for name in ckpt.entries):
        return True
    logger.warning("checkpoint %s has no vision tower (vision.*) weights although config.json has a vision_config "
                   "with %d layers; image input will not be available", root, config.vision.num_hidden_layers)
    return False


def _skip_non_backbone(ckpt: SafetensorsCheckpoint, root: Path, keep_dspark: bool = False,
                       keep_vision: bool = False) -> None:
    skipped = [name for name in ckpt.entries if is_skipped(name, keep_dspark, keep_vision)]
    if not skipped:
        return
    counts = Counter(next(p for p in SKIPPED_PREFIXES if name.removeprefix("model.").startswith(p))
                     for name in skipped)
    logger.info("checkpoint %s: not loading %d tensors outside the backbone (%s)", root, len(skipped),
                ", ".join(f"{p}*: {n}" for p, n in sorted(counts.items())))
    for name in skipped:
        del ckpt.entries[name]


def _check_engram_dtypes(ckpt: SafetensorsCheckpoint) -> None:
    for name, entry in ckpt.entries.items():
        if is_engram_table(name):
            want = _ENGRAM_DTYPES[name.rsplit(".", 1)[-1]]
            if entry.dtype != want:
                ckpt.problems.dtype.append(f"{name}: dtype {entry.dtype}, expected {want} (the Engram tables are "
                                           f"FP8 e4m3 with one ue8m0 scale per 32 channels of a row)")


def load_checkpoint(path: str | Path, dtype: torch.dtype | str | None = torch.bfloat16,
                    config_dict: dict | None = None, weight_formats: tuple[str, ...] = ()
                    ) -> tuple[DeepseekV41Config, dict[str, torch.Tensor]]:
    """Load a DeepSeek-V4.1 checkpoint folder: (config, {official name: tensor}) plus the derived
    `engram.token_map` when the model has Engram layers.

    `dtype` is the dtype of ordinary float weights ("auto": the checkpoint's). `config_dict`: the
    folder's config.json when the caller has read it already, else it is read here.
    `weight_formats`: the quantised formats the back end computes on (`Capabilities.weight_formats`,
    e.g. `fp8_block32`, `fp4_e2m1`): the weights of those formats that `weights.is_quantizable`
    accepts stay quantised (`QuantizedWeight`); the others are dequantised. Raises
    FileNotFoundError (no config.json / no weights); CheckpointError (a ValueError) for a config
    value of the wrong type or out of range, a corrupt file, index entries outside the folder,
    missing / unexpected / mis-shaped / wrongly typed / badly quantised tensors (all listed at once),
    or a missing or foreign tokenizer for the Engram layers -- all before reading tensor data;
    CheckpointTooLargeError (a MemoryError) when the loaded tensors, the memory-mapped Engram tables
    not counted, would not fit in RAM.
    """
    root, config = _common.checkpoint_config(path, config_dict, parse_config)
    ckpt = SafetensorsCheckpoint(root, block_size=block_size(config))
    dspark = _with_dspark(ckpt, root, config)
    vision = _with_vision(ckpt, root, config)
    _skip_non_backbone(ckpt, root, dspark, vision)
    dtype = _common.resolve_dtype(dtype, ckpt.entries, DTYPE_REFERENCE_NAMES)
    _check_engram_dtypes(ckpt)
    units = ckpt.plan(config.expert_dtype, keep_stored=is_engram_table)
    ckpt.keep_quantized(weight_formats, is_quantizable)
    shapes, sizes = ckpt.loaded_shapes(units, canonicalize, target_dtype, dtype)
    expected = expected_weight_shapes(config) | (dspark_weight_shapes(config) if dspark else {})
    if vision:
        expected |= vision_weight_shapes(config.vision, config.hidden_size)
    ckpt.validate(expected, shapes, naming="official")
    token_map = engram_token_map(root, config) if config.engram_layer_ids else None

    in_ram = sum(n for name, n in sizes.items() if weight_kind(name) != "quantized")
    ckpt.check_memory(in_ram + (0 if token_map is None else token_map.numel() * 8), dtype, smaller=_SMALLER)
    tensors = ckpt.load(units, canonicalize, target_dtype, dtype, whole=FINITE_WHOLE)
    if token_map is not None:
        tensors[TOKEN_MAP] = token_map
    return config, tensors
