"""Load a DeepSeek-V4 checkpoint directory into canonical (official-name) tensors.

`load_checkpoint(path, dtype)` reads `config.json` plus safetensors (a single `model.safetensors`,
or shards listed in `model.safetensors.index.json`), in any of the three naming forms (official,
transformers-internal, transformers' save_pretrained hybrid; see `weights.canonicalize`), and
dequantises quantised weights on the way (`quant.py`): FP8 e4m3 with 128x128 block scales stored
as `<w>.scale` (official) or `<w>.weight_scale_inv` / `<fused>_scale_inv` (transformers), and
packed FP4 e2m1 experts with one scale per 32 inputs. The format is chosen by the weight's dtype.

Everything is checked before any tensor data is read, each problem a `CheckpointError`: every
config.json value's type and range (`config.FIELD_RANGES`); each safetensors file's layout
(`read_safetensors_header`: header length, JSON header, dtypes, offsets inside the file, shape x
item size = byte span; a truncated or corrupt file is named); shard-index entries (they must stay
inside the checkpoint folder); names, shapes and dtypes against the config (one error listing every
problem); and the memory the loaded tensors will take against the RAM available
(`CheckpointTooLargeError`). Once read, the hash-routing tables are checked to hold expert ids in
[0, n_routed_experts) (`weights.check_hash_tables`). Files are memory-mapped (`safe_open`) and converted one
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
from safetensors import SafetensorError, safe_open

from deepinfer.models.deepseek_v4 import quant
from deepinfer.models.deepseek_v4.config import SUPPORTED_MODEL_TYPES, CheckpointError, DeepseekV4Config
from deepinfer.models.deepseek_v4.weights import canonicalize, check_hash_tables, expected_weight_shapes, weight_kind

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_LISTED = 200  # problems listed per category in one error (the count is always exact)
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on the JSON header

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu, "F4": torch.float4_e2m1fn_x2,
}
# bits per stored value where it is not the torch dtype's (the header counts fp4 values, torch packs two)
_SAFETENSORS_BITS = {"F4": 4}
# dtype codes of the safetensors format that deepinfer does not load (valid files, unsupported)
_OTHER_SAFETENSORS_DTYPES = ("U16", "U32", "U64", "F6_E2M3", "F6_E3M2", "C64")
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16}


class CheckpointTooLargeError(MemoryError):
    """Loading the checkpoint would need more RAM than is available."""


# --- reading the directory ---------------------------------------------------------------------

def read_config(path: str | Path) -> dict:
    """The checkpoint's `config.json` as a dict (FileNotFoundError in DeepInfer's wording if absent;
    CheckpointError if it is not JSON or not a JSON object)."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"HF checkpoint requires config.json: {config_path} does not exist. Point the model path at "
            f"the folder that holds config.json and the *.safetensors files (or the download is incomplete).")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} must hold a JSON object with the model's settings (got "
                              f"{_kind(config)})")
    return config


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


def _allowed_roots(root: Path) -> list[Path]:
    """Where the files of a checkpoint folder may live: the folder itself, plus the repository's
    `blobs/` for a Hugging Face cache snapshot (`models--org--name/snapshots/<rev>/`, whose files
    are symlinks into `../../blobs/`)."""
    real = root.resolve()
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        roots.append(real.parent.parent / "blobs")
    return roots


def _shard_path(root: Path, index: Path, tensor: str, name: object) -> Path:
    """The shard file of one `weight_map` entry, refused unless it stays inside the checkpoint folder."""
    entry = f"{index}: weight_map entry {tensor!r}: {name!r}"
    if not isinstance(name, str) or not name.strip():
        raise CheckpointError(f"{entry} must be a file name (a non-empty string) relative to {root}")
    parts = Path(name).parts
    if Path(name).is_absolute() or name.startswith(("/", "\\")) or ".." in parts or "\\" in name:
        raise CheckpointError(f"{entry} points outside the checkpoint folder {root}; shard entries must be file "
                              f"names relative to that folder")
    path = root / name
    real = path.resolve()
    if not any(real.is_relative_to(r) for r in _allowed_roots(root)):
        raise CheckpointError(f"{entry} is a symlink to {real}, outside the checkpoint folder {root.resolve()}; "
                              f"copy the shard into the folder instead")
    return path


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards of the index, else `model.safetensors`. Index
    entries must name files inside the folder (no absolute paths, no `..`, no symlinks out)."""
    root = Path(path)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (not JSON: {e})") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{index} is not a valid safetensors index: it must hold a JSON object with a "
                                  f"'weight_map' (got {_kind(data)})")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} is not a valid safetensors index: 'weight_map' must be an object of "
                                  f"tensor name -> shard file name (got {_kind(weight_map)})")
        files: dict[str, Path] = {}
        for tensor, name in weight_map.items():
            if not isinstance(name, str) or name not in files:
                files[name] = _shard_path(root, index, tensor, name)
        files_list = [files[name] for name in sorted(files)]
        absent = [f.name for f in files_list if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that are not in {root}: {', '.join(absent)} "
                                    f"(incomplete download?)")
        return files_list
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    found = sorted(p.name for p in root.glob("*.safetensors"))
    hint = f" (found {', '.join(found)} but no {INDEX_FILE} listing them)" if found else ""
    raise FileNotFoundError(f"no weights in {root}: expected {SINGLE_FILE} or {INDEX_FILE}{hint}")


def _kind(value: object) -> str:
    """How a JSON value is called in messages: "a list", "a string", "null", ..."""
    names = {list: "a list", str: "a string", dict: "an object", bool: "a bool", int: "an integer", float: "a float"}
    return "null" if value is None else names.get(type(value), f"a {type(value).__name__}")


class _NotJSON(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise _NotJSON(f"key {k!r} appears twice")
        out[k] = v
    return out


def read_safetensors_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (safetensors dtype code, shape as stored)} of one file, after checking the whole
    layout against the file size: an 8-byte little-endian header length that fits the file, a JSON
    object header, for every tensor a supported dtype, a shape of non-negative integers and
    data_offsets inside the data section whose span is exactly shape x item size, and tensors that
    tile the data section with no gap, overlap or trailing bytes (what the safetensors library
    requires too). Any violation is a CheckpointError naming the file."""

    def corrupt(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint file {file} is truncated or corrupt (not a valid safetensors file): "
                               f"{why}. Download or write it again.")

    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise corrupt(f"{size} bytes, too short for the 8-byte header length")
            n = int.from_bytes(prefix, "little")
            if n > size - 8:
                raise corrupt(f"the header claims {n} bytes but only {size - 8} follow the length field")
            if n > MAX_HEADER_BYTES:
                raise corrupt(f"the header claims {n} bytes, more than the {MAX_HEADER_BYTES} safetensors allows")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"checkpoint file {file} cannot be read: {e}") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, _NotJSON) as e:
        raise corrupt(f"the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise corrupt(f"the header is not a JSON object (got {_kind(header)})")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise corrupt("__metadata__ must be an object of strings")
    data_len = size - 8 - n
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise corrupt(f"tensor {name} must be an object with dtype, shape and data_offsets (got {info!r:.80})")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if code in _OTHER_SAFETENSORS_DTYPES:
            raise CheckpointError(f"checkpoint file {file}: tensor {name} has dtype {code}, which deepinfer does not "
                                  f"load (supported: {', '.join(_SAFETENSORS_DTYPES)})")
        if code not in _SAFETENSORS_DTYPES:
            raise corrupt(f"tensor {name} has unsupported dtype {code!r} (not a safetensors dtype; supported: "
                          f"{', '.join(_SAFETENSORS_DTYPES)})")
        if not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                  for x in shape):
            raise corrupt(f"tensor {name}: shape {shape!r:.80} must be a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise corrupt(f"tensor {name}: data_offsets {offsets!r:.80} must be two integers 0 <= begin <= end")
        begin, end = offsets
        if end > data_len:
            raise corrupt(f"tensor {name} ends at byte {end} of the data but the file holds only {data_len} bytes "
                          f"of data")
        bits = _SAFETENSORS_BITS.get(code, _SAFETENSORS_DTYPES[code].itemsize * 8)
        count = 1
        for x in shape:
            count *= x
        if code == "F4" and shape and shape[-1] % 2:
            raise corrupt(f"tensor {name}: packed F4 shape {shape} needs an even last dimension")
        if count * bits % 8 or count * bits // 8 != end - begin:
            item = f"{bits // 8}" if bits % 8 == 0 else f"{bits / 8}"
            total = count * bits // 8 if count * bits % 8 == 0 else count * bits / 8
            raise corrupt(f"tensor {name}: shape {shape} x {item} bytes = {total} bytes but data_offsets "
                          f"span {end - begin}")
        out[name] = (code, tuple(shape))
        spans.append((begin, end, name))
    position, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin < position:
            raise corrupt(f"tensors {previous} and {name} overlap (bytes {begin}..{position} of the data)")
        if begin > position:
            raise corrupt(f"a gap of {begin - position} bytes before tensor {name}")
        position, previous = end, name
    if position != data_len:
        raise corrupt(f"{data_len - position} bytes after the last tensor (the header accounts for {position} of "
                      f"{data_len} data bytes)")
    return out


@dataclass(frozen=True)
class _Entry:
    """One stored tensor, from the file header (no data read)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]  # as torch will see it (packed FP4 counts bytes)


def _read_headers(files: list[Path]) -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for file in files:
        for name, (code, shape) in read_safetensors_header(file).items():
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
        self.dtype: list[str] = []


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
                                      ("tensors stored under two names", problems.duplicate),
                                      ("tensors with the wrong dtype", problems.dtype)) if xs]
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
        with _opened(file) as f:
            for u in file_units:
                tensor = _get_tensor(f, file, u.name)
                if u.scale_name is not None:
                    scale_file = entries[u.scale_name].file
                    if scale_file == file:
                        scale = _get_tensor(f, file, u.scale_name)
                    else:
                        with _opened(scale_file) as g:
                            scale = _get_tensor(g, scale_file, u.scale_name)
                    # dequantise in fp32 (exact), then round once to the target dtype below
                    tensor = quant.dequantize(tensor, scale, torch.float32)
                for name, piece in canonicalize({u.name: tensor}).items():
                    yield name, piece.to(_target_dtype(name, dtype)).contiguous()


# The headers were validated before (read_safetensors_header); a file that changed since, or that
# the library still refuses, is reported by name instead of as a bare SafetensorError.
_READ_ERRORS = (SafetensorError, OSError, RuntimeError)


def _unreadable(file: Path, what: str, e: Exception) -> CheckpointError:
    return CheckpointError(f"checkpoint file {file} could not be read ({what}; truncated or corrupt, or changed "
                           f"while loading?): {e}")


def _opened(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except _READ_ERRORS as e:
        raise _unreadable(file, "opening it", e) from None


def _get_tensor(f, file: Path, name: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except _READ_ERRORS as e:
        raise _unreadable(file, f"tensor {name}", e) from None


def load_checkpoint(path: str | Path, dtype: torch.dtype | str | None = torch.bfloat16
                    ) -> tuple[DeepseekV4Config, dict[str, torch.Tensor]]:
    """Load a DeepSeek-V4 checkpoint directory: (config, {official name: tensor}).

    `dtype` is the dtype of ordinary float weights ("auto": the checkpoint's). Raises
    FileNotFoundError (no config.json / no weights) and CheckpointError (a ValueError) for: a
    config.json that is not a JSON object, an unsupported model_type or any value of the wrong type
    or out of range (`config.FIELD_RANGES`); a truncated or corrupt safetensors file
    (`read_safetensors_header`); index entries outside the folder; missing, unexpected, mis-shaped,
    wrongly typed or badly quantised tensors (all listed at once) -- all before reading tensor
    data -- and, once read, hash-routing tables with expert ids outside [0, n_routed_experts).
    CheckpointTooLargeError (a MemoryError) when the loaded tensors would not fit in RAM.
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
    for name, entry in entries.items():
        if name.endswith("tid2eid") and (entry.dtype.is_floating_point or entry.dtype == torch.bool):
            problems.dtype.append(f"{name}: dtype {entry.dtype}, expected an integer dtype (expert ids)")
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
    check_hash_tables(tensors, config)
    return config, tensors
