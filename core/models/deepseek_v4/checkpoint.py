"""Load a DeepSeek-V4 checkpoint directory into canonical (official-name) tensors.

`load_checkpoint(path, dtype)` reads `config.json` plus safetensors (a single `model.safetensors`,
or shards listed in `model.safetensors.index.json`), in any of the three naming forms (official,
transformers-internal, transformers' save_pretrained hybrid; see `weights.canonicalize`), and
dequantises quantised weights on the way (`quant.py`): FP8 e4m3 with 128x128 block scales stored
as `<w>.scale` (official) or `<w>.weight_scale_inv` / `<fused>_scale_inv` (transformers), and
packed FP4 e2m1 experts with one scale per 32 inputs. The format is chosen by the weight's dtype.

Everything is checked from the safetensors headers before any tensor data is read: names and
shapes against the config (one error listing every problem), and the memory the loaded tensors
will take against the RAM available. Files are memory-mapped (`safe_open`) and converted one
tensor at a time, so the peak is about the loaded size plus one tensor.

Loaded dtypes follow `weights.weight_kind`: "float" tensors in `dtype`, "fp32" tensors (sinks,
position biases, mHC parameters, router bias) in float32, the hash table `tid2eid` as int64.
A checkpoint without any `mtp.*` tensor (e.g. written by transformers, which drops them) loads
with `num_nextn_predict_layers = 0` and a warning.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer.models.deepseek_v4 import quant
from deepinfer.models.deepseek_v4.config import SUPPORTED_MODEL_TYPES, DeepseekV4Config
from deepinfer.models.deepseek_v4.weights import canonicalize, expected_weight_shapes, weight_kind

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_LISTED = 200  # problems listed per category in one error (the count is always exact)

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu, "F4": torch.float4_e2m1fn_x2,
}
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16}


class CheckpointError(ValueError):
    """The checkpoint does not fit its config (names, shapes, quantisation)."""


class CheckpointTooLargeError(MemoryError):
    """Loading the checkpoint would need more RAM than is available."""


# --- reading the directory ---------------------------------------------------------------------

def read_config(path: str | Path) -> dict:
    """The checkpoint's `config.json` as a dict (FileNotFoundError in DeepInfer's wording if absent)."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"HF checkpoint requires config.json: {config_path} does not exist. Point the model path at "
            f"the folder that holds config.json and the *.safetensors files (or the download is incomplete).")
    try:
        return json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None


def parse_config(config_dict: dict, source: str = CONFIG_FILE) -> DeepseekV4Config:
    """`DeepseekV4Config` from a config dict; an unknown model_type names the supported ones."""
    model_type = config_dict.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return DeepseekV4Config.from_dict(config_dict)


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards of the index, else `model.safetensors`."""
    root = Path(path)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from None
        files = [root / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that are not in {root}: {', '.join(absent)} "
                                    f"(incomplete download?)")
        return files
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    found = sorted(p.name for p in root.glob("*.safetensors"))
    hint = f" (found {', '.join(found)} but no {INDEX_FILE} listing them)" if found else ""
    raise FileNotFoundError(f"no weights in {root}: expected {SINGLE_FILE} or {INDEX_FILE}{hint}")


@dataclass(frozen=True)
class _Entry:
    """One stored tensor, from the file header (no data read)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]  # as torch will see it (packed FP4 counts bytes)


def _read_headers(files: list[Path]) -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                info = f.get_slice(name)
                code = info.get_dtype()
                if code not in _SAFETENSORS_DTYPES:
                    raise CheckpointError(f"{file.name}: tensor {name} has unsupported dtype {code}")
                shape = tuple(info.get_shape())
                if code == "F4":  # the header counts fp4 values; torch packs two per element
                    shape = (*shape[:-1], shape[-1] // 2)
                if name in entries:
                    raise CheckpointError(f"tensor {name} is stored twice ({entries[name].file.name}, {file.name})")
                entries[name] = _Entry(file, _SAFETENSORS_DTYPES[code], shape)
    return entries


# --- pairing quantised weights with their scales -----------------------------------------------

@dataclass(frozen=True)
class _Unit:
    """What becomes one (or, for fused experts, several) loaded tensors: a weight and its scale."""

    name: str
    scale_name: str | None


def _scale_candidates(name: str) -> list[str]:
    if name.endswith(".weight"):
        base = name[: -len(".weight")]
        return [base + ".scale", name + "_scale_inv"]  # official, transformers
    return [name + "_scale_inv", name + "_scale"]  # transformers' fused experts


def _plan_units(entries: dict[str, _Entry], problems: _Problems, expert_dtype: str | None) -> list[_Unit]:
    quantised = quant.FP8_DTYPES + quant.FP4_DTYPES
    units: list[_Unit] = []
    used_scales: set[str] = set()
    for name, entry in entries.items():
        scale = next((s for s in _scale_candidates(name) if s in entries), None)
        if entry.dtype not in quantised:
            units.append(_Unit(name, None))
            continue
        if scale is None:
            problems.quant.append(f"{name} ({entry.dtype}) has no scale tensor "
                                  f"(looked for {' or '.join(_scale_candidates(name))})")
            continue
        used_scales.add(scale)
        if quant.quant_format(entry.dtype) == "fp4" and expert_dtype == "fp8":
            problems.quant.append(f"{name} is packed FP4 ({entry.dtype}) but config.json says expert_dtype 'fp8'")
            continue
        want = quant.expected_scale_shape(entry.shape, entry.dtype)
        if entries[scale].shape != want:
            problems.quant.append(f"{scale}: shape {entries[scale].shape} does not fit the "
                                  f"{quant.quant_format(entry.dtype)} weight {name} {entry.shape}; expected {want}")
            continue
        units.append(_Unit(name, scale))
    # drop the scales from the plain units; a scale-looking tensor without a quantised weight stays
    # (mHC `attn_hc.scale` and similar are real parameters) and is checked against the config.
    return [u for u in units if u.name not in used_scales]


# --- validation --------------------------------------------------------------------------------

class _Problems:
    """Problems found while planning the load, reported together with the name checks."""

    def __init__(self) -> None:
        self.quant: list[str] = []
        self.duplicate: list[str] = []


def _listing(title: str, items: list[str]) -> str:
    shown = items[:MAX_LISTED]
    more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"  {title} ({len(items)}):\n" + "\n".join(f"    {x}" for x in shown) + more


def _validate(shapes: dict[str, tuple[int, ...]], config: DeepseekV4Config, problems: _Problems,
              path: Path) -> None:
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = sorted(f"{k}: checkpoint {shapes[k]}, config expects {expected[k]}"
                   for k in set(shapes) & set(expected) if shapes[k] != expected[k])
    sections = [(t, xs) for t, xs in (("missing tensors", missing), ("unexpected tensors", unexpected),
                                      ("tensors with the wrong shape", wrong),
                                      ("quantisation problems", problems.quant),
                                      ("tensors stored under two names", problems.duplicate)) if xs]
    if sections:
        body = "\n".join(_listing(t, xs) for t, xs in sections)
        raise CheckpointError(
            f"checkpoint {path} does not match its config.json (names are shown in official naming):\n{body}\n"
            f"Check that config.json belongs to these weights and that all shards are present.")


# --- memory ------------------------------------------------------------------------------------

def available_memory_bytes() -> int:
    """RAM that can be allocated without swapping (MemAvailable), or total RAM where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown platform: do not block loading


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _check_memory(loaded_bytes: int, disk_bytes: int, dtype: torch.dtype, path: Path) -> None:
    available = available_memory_bytes()
    if loaded_bytes > available:
        raise CheckpointTooLargeError(
            f"checkpoint {path} needs about {_gib(loaded_bytes)} of RAM once loaded as {_dtype_name(dtype)} "
            f"({_gib(disk_bytes)} on disk; quantised FP8/FP4 weights are dequantised on load), but only "
            f"{_gib(available)} is available. Fix: free memory or use a machine with more RAM, load in "
            f"bfloat16 if you asked for float32, or use a smaller checkpoint (e.g. one written by "
            f"`deepinfer make-model`).")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --- loading -----------------------------------------------------------------------------------

def resolve_dtype(dtype: torch.dtype | str | None, entries: dict[str, _Entry] | None = None) -> torch.dtype:
    """A torch float dtype from a dtype or its name; "auto"/None picks the checkpoint's float dtype
    (its embedding's, or bfloat16 for quantised checkpoints)."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise ValueError(f"load dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if dtype in (None, "auto"):
        if entries:
            for name in ("embed.weight", "model.embed_tokens.weight"):
                if name in entries and entries[name].dtype in (torch.float32, torch.bfloat16, torch.float16):
                    return entries[name].dtype
        return torch.bfloat16
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16, float16 or auto")


def _target_dtype(official_name: str, dtype: torch.dtype) -> torch.dtype:
    kind = weight_kind(official_name)
    return torch.int64 if kind == "int" else torch.float32 if kind == "fp32" else dtype


def _meta_unit(unit: _Unit, entries: dict[str, _Entry]) -> torch.Tensor:
    e = entries[unit.name]
    if unit.scale_name is None:
        return torch.empty(e.shape, dtype=e.dtype, device="meta")
    return torch.empty(quant.dequantized_shape(e.shape, e.dtype), dtype=torch.float32, device="meta")


def _iter_loaded(units: list[_Unit], entries: dict[str, _Entry], dtype: torch.dtype
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, tensor) for every unit, reading files through memory maps."""
    by_file: dict[Path, list[_Unit]] = {}
    for u in units:
        by_file.setdefault(entries[u.name].file, []).append(u)
    for file, file_units in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for u in file_units:
                tensor = f.get_tensor(u.name)
                if u.scale_name is not None:
                    scale_file = entries[u.scale_name].file
                    if scale_file == file:
                        scale = f.get_tensor(u.scale_name)
                    else:
                        with safe_open(str(scale_file), framework="pt") as g:
                            scale = g.get_tensor(u.scale_name)
                    # dequantise in fp32 (exact), then round once to the target dtype below
                    tensor = quant.dequantize(tensor, scale, torch.float32)
                for name, piece in canonicalize({u.name: tensor}).items():
                    yield name, piece.to(_target_dtype(name, dtype)).contiguous()


def load_checkpoint(path: str | Path, dtype: torch.dtype | str | None = torch.bfloat16
                    ) -> tuple[DeepseekV4Config, dict[str, torch.Tensor]]:
    """Load a DeepSeek-V4 checkpoint directory: (config, {official name: tensor}).

    `dtype` is the dtype of ordinary float weights ("auto": the checkpoint's). Raises
    FileNotFoundError (no config.json / no weights), ValueError (unsupported model_type),
    CheckpointError (missing, unexpected, mis-shaped or badly quantised tensors, all listed at once)
    and CheckpointTooLargeError (not enough RAM), all before reading tensor data.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {root}")
    config_dict = read_config(root)
    config = parse_config(config_dict, str(root / CONFIG_FILE))
    files = safetensors_files(root)
    entries = _read_headers(files)
    dtype = resolve_dtype(dtype, entries)

    problems = _Problems()
    units = _plan_units(entries, problems, config.expert_dtype)
    shapes: dict[str, tuple[int, ...]] = {}
    sizes: dict[str, int] = {}
    sources: dict[str, str] = {}
    for unit in units:
        try:
            pieces = canonicalize({unit.name: _meta_unit(unit, entries)})
        except ValueError as e:
            problems.duplicate.append(f"{unit.name}: {e}")
            continue
        for name, t in pieces.items():
            if name in shapes:
                problems.duplicate.append(f"{name}: from {sources[name]} and {unit.name}")
                continue
            shapes[name], sources[name] = tuple(t.shape), unit.name
            sizes[name] = t.numel() * _target_dtype(name, dtype).itemsize

    if config.num_nextn_predict_layers and not any(n.startswith("mtp.") for n in shapes):
        logger.warning("checkpoint %s has no MTP (mtp.*) weights although config.json sets "
                       "num_nextn_predict_layers=%d; loading without MTP (no speculative decoding)",
                       root, config.num_nextn_predict_layers)
        config = config.model_copy(update={"num_nextn_predict_layers": 0})
    _validate(shapes, config, problems, root)
    _check_memory(sum(sizes.values()), sum(f.stat().st_size for f in files), dtype, root)

    tensors = dict(_iter_loaded(units, entries, dtype))
    return config, tensors
