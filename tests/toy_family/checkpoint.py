"""The toy family's checkpoint loader and writer, built on the shared, validated file reading, and
its random checkpoints for `deepinfer make-model --family toy` (`make_checkpoint`, `add_arguments`)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from deepinfer.models.common.checkpoint import SafetensorsCheckpoint, resolve_dtype
from deepinfer.models.common.safetensors_io import CONFIG_FILE, read_config, write_safetensors
from toy_family.config import FULL, SLIDING, ToyConfig, parse_config
from toy_family.weights import canonicalize, expected_shapes, random_weights, target_dtype, to_hf_names


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


# make-model presets: full (owns its KV), sliding, full reading layer 0's KV, sliding
SIZES = {"tiny": dict(hidden_size=32, num_heads=4, head_dim=8, intermediate_size=64),
         "small": dict(hidden_size=64, num_heads=4, head_dim=16, intermediate_size=128)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sliding-window", type=int, default=5, help="window of the sliding-attention layers")


def make_checkpoint(out_dir: str | Path, size: str = "tiny", seed: int = 0, overwrite: bool = False, *,
                    sliding_window: int = 5) -> str:
    """A random toy checkpoint (vocabulary 97, 4 layers) for `deepinfer make-model --family toy`."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; choose another directory or pass --force")
    config = ToyConfig(vocab_size=97, layer_types=(FULL, SLIDING, FULL, SLIDING), kv_source=(None, None, 0, None),
                       sliding_window=sliding_window, **SIZES[size])
    write_checkpoint(out, config, random_weights(config, seed))
    return f"wrote {out}: toy_dense {size}, seed {seed}, sliding window {sliding_window}"
