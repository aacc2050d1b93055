"""Load a DeepSeek-V4 checkpoint directory into canonical (official-name) tensors.

`load_checkpoint(path, dtype)` reads `config.json` plus safetensors (a single `model.safetensors`,
or shards listed in `model.safetensors.index.json`), in any of the three naming forms (official,
transformers-internal, transformers' save_pretrained hybrid; see `weights.canonicalize`), and
dequantises quantised weights on the way (`common/quant.py`): FP8 e4m3 with 128x128 block scales
stored as `<w>.scale` (official) or `<w>.weight_scale_inv` / `<fused>_scale_inv` (transformers), and
packed FP4 e2m1 experts with one scale per 32 inputs. The format is chosen by the weight's dtype.
`load_checkpoint(..., weight_formats=...)` keeps the linear weights (`weights.is_quantizable`) of
the formats the back end declares quantised instead (`QuantizedWeight`, docs/checkpoints.md).

Everything is checked before any tensor data is read, each problem a `CheckpointError`: every
config.json value's type and range (`config.FIELD_RANGES`); each safetensors file's layout
(`read_safetensors_header`: header length, JSON header, dtypes, offsets inside the file, shape x
item size = byte span; a truncated or corrupt file is named); shard-index entries (they must stay
inside the checkpoint folder); names, shapes and dtypes against the config (one error listing every
problem); and the memory the loaded tensors will take against the RAM available
(`CheckpointTooLargeError`). Once read, the hash-routing tables are checked to hold expert ids in
[0, n_routed_experts) (`weights.check_hash_tables`). Files are memory-mapped (`safe_open`) and converted one
tensor at a time, so the peak is about the loaded size plus one tensor.

The file reading and validation is the family-independent part (`deepinfer.models.common`:
`safetensors_io`, `checkpoint`); what is V4's here is the config parser, the naming, the expected
shapes, the per-tensor dtypes and the MTP rule below.

Loaded dtypes follow `weights.weight_kind`: "float" tensors in `dtype`, "fp32" tensors (sinks,
position biases, mHC parameters, router bias) in float32, the hash table `tid2eid` as int64.
A checkpoint without any `mtp.*` tensor (e.g. written by transformers, which drops them) loads
with `num_nextn_predict_layers = 0` and a warning.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from deepinfer.models.common import checkpoint as _common
from deepinfer.models.common.checkpoint import (  # noqa: F401  (re-exported)
    MAX_LISTED, SafetensorsCheckpoint, available_memory_bytes,
)
from deepinfer.models.common.config_values import fp8_block_size
from deepinfer.models.common.config_values import type_name as _kind
from deepinfer.models.common.quant import FP8_BLOCK
from deepinfer.models.common.errors import CheckpointTooLargeError  # noqa: F401  (re-exported)
from deepinfer.models.common.safetensors_io import (  # noqa: F401  (re-exported)
    CONFIG_FILE, INDEX_FILE, MAX_HEADER_BYTES, SINGLE_FILE, TensorEntry, read_config, read_headers,
    read_safetensors_header, safetensors_files,
)
from deepinfer.models.deepseek_v4.config import SUPPORTED_MODEL_TYPES, CheckpointError, DeepseekV4Config
from deepinfer.models.deepseek_v4.weights import (
    canonicalize, check_hash_tables, expected_weight_shapes, is_quantizable, weight_kind,
)

logger = logging.getLogger(__name__)

# the embedding's stored dtype is the checkpoint's dtype ("auto")
DTYPE_REFERENCE_NAMES = ("embed.weight", "model.embed_tokens.weight")
# checked for NaN / infinity entirely at load, whatever their size (the others: see common/finite.py)
FINITE_WHOLE = ("embed.weight",)
_SMALLER = "a smaller checkpoint (e.g. one written by `deepinfer make-model`)"


def parse_config(config_dict: dict, source: str = CONFIG_FILE) -> DeepseekV4Config:
    """`DeepseekV4Config` from a config dict; an unknown model_type names the supported ones. Every
    value is type- and range-checked (see `config.FIELD_RANGES`): CheckpointError naming the key,
    the value and the valid range."""
    if not isinstance(config_dict, dict):
        raise CheckpointError(f"{source} must hold a JSON object with the model's settings (got "
                              f"{_kind(config_dict)})")
    model_type = config_dict.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return DeepseekV4Config.from_dict(config_dict, source)


def resolve_dtype(dtype: torch.dtype | str | None, entries: dict[str, TensorEntry] | None = None) -> torch.dtype:
    """A torch float dtype from a dtype or its name; "auto"/None picks the checkpoint's float dtype
    (its embedding's, or bfloat16 for quantised checkpoints)."""
    return _common.resolve_dtype(dtype, entries, DTYPE_REFERENCE_NAMES)


def target_dtype(official_name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype one loaded tensor is kept in (`weights.weight_kind`)."""
    kind = weight_kind(official_name)
    return torch.int64 if kind == "int" else torch.float32 if kind == "fp32" else dtype


def load_checkpoint(path: str | Path, dtype: torch.dtype | str | None = torch.bfloat16,
                    config_dict: dict | None = None, weight_formats: tuple[str, ...] = ()
                    ) -> tuple[DeepseekV4Config, dict[str, torch.Tensor]]:
    """Load a DeepSeek-V4 checkpoint directory: (config, {official name: tensor}).

    `dtype` is the dtype of ordinary float weights ("auto": the checkpoint's). `config_dict`: the
    folder's config.json when the caller has read it already (the model registry does), else it is
    read here. `weight_formats`: the quantised formats the back end computes on
    (`Capabilities.weight_formats`, e.g. `fp8_block128`, `fp4_e2m1`): the weights of those formats
    that `weights.is_quantizable` accepts stay quantised (`QuantizedWeight`); all others are
    dequantised. Raises FileNotFoundError (no config.json / no weights) and CheckpointError (a
    ValueError) for: a config.json that is not a JSON object, an unsupported model_type or any value
    of the wrong type or out of range (`config.FIELD_RANGES`); a truncated or corrupt safetensors
    file (`read_safetensors_header`); index entries outside the folder; missing, unexpected,
    mis-shaped, wrongly typed or badly quantised tensors (all listed at once) -- all before reading
    tensor data -- and, once read, hash-routing tables with expert ids outside [0, n_routed_experts).
    CheckpointTooLargeError (a MemoryError) when the loaded tensors would not fit in RAM.
    """
    root, config = _common.checkpoint_config(path, config_dict, parse_config)
    # FP8 blocks of quantization_config.weight_block_size (checked with the config), else the official 128
    ckpt = SafetensorsCheckpoint(root, block_size=fp8_block_size(config.quantization_config, FP8_BLOCK))
    dtype = resolve_dtype(dtype, ckpt.entries)

    for name, entry in ckpt.entries.items():
        if name.endswith("tid2eid") and (entry.dtype.is_floating_point or entry.dtype == torch.bool):
            ckpt.problems.dtype.append(f"{name}: dtype {entry.dtype}, expected an integer dtype (expert ids)")
    units = ckpt.plan(config.expert_dtype)
    ckpt.keep_quantized(weight_formats, is_quantizable)
    shapes, sizes = ckpt.loaded_shapes(units, canonicalize, target_dtype, dtype)

    if config.num_nextn_predict_layers and not any(n.startswith("mtp.") for n in shapes):
        logger.warning("checkpoint %s has no MTP (mtp.*) weights although config.json sets "
                       "num_nextn_predict_layers=%d; loading without MTP (no speculative decoding)",
                       root, config.num_nextn_predict_layers)
        config = config.model_copy(update={"num_nextn_predict_layers": 0})
    ckpt.validate(expected_weight_shapes(config), shapes, naming="official")
    ckpt.check_memory(sum(sizes.values()), dtype, smaller=_SMALLER)

    tensors = ckpt.load(units, canonicalize, target_dtype, dtype, whole=FINITE_WHOLE)
    check_hash_tables(tensors, config)
    return config, tensors
