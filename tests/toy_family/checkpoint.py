"""The toy family's checkpoint loader and writer, built on the shared, validated file reading."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from deepinfer.models.common.checkpoint import SafetensorsCheckpoint, resolve_dtype
from deepinfer.models.common.safetensors_io import CONFIG_FILE, read_config, write_safetensors
from toy_family.config import ToyConfig, parse_config
from toy_family.weights import canonicalize, expected_shapes, target_dtype, to_hf_names


def load_checkpoint(path: str | Path, dtype: torch.dtype | str | None = None, config_dict: dict | None = None
                    ) -> tuple[ToyConfig, dict[str, torch.Tensor]]:
    root = Path(path)
    if config_dict is None:
        config_dict = read_config(root)
    config = parse_config(config_dict, str(root / CONFIG_FILE))
    ckpt = SafetensorsCheckpoint(root)  # files, shard index and every header validated here
    dtype = resolve_dtype(dtype, ckpt.entries, ("model.embed_tokens.weight",))
    units = ckpt.plan()  # FP8 / FP4 weights are paired with their scales and dequantised on load
    shapes, sizes = ckpt.loaded_shapes(units, canonicalize, target_dtype, dtype)
    ckpt.validate(expected_shapes(config), shapes)
    ckpt.check_memory(sum(sizes.values()), dtype)
    return config, ckpt.load(units, canonicalize, target_dtype, dtype)


def write_checkpoint(out_dir: str | Path, config: ToyConfig, weights: dict[str, torch.Tensor],
                     stored: dict[str, torch.Tensor] | None = None, max_shard_bytes: int = 2**30) -> Path:
    """config.json + safetensors under HF names (or `stored`, tensors already under stored names)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2))
    write_safetensors(stored if stored is not None else to_hf_names(weights), out, max_shard_bytes=max_shard_bytes)
    return out
