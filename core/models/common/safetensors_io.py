"""Reading (and writing) a checkpoint folder's files: `config.json` and safetensors, validated.

Nothing here knows a model. `read_config` reads `config.json` as a dict; `safetensors_files` lists
the weight files (a single `model.safetensors`, or the shards of `model.safetensors.index.json`),
which must stay inside the folder and be regular files (`files.regular_file`);
`read_safetensors_header` checks one file's whole layout against its size before the safetensors
library opens it; `read_headers` gives every
stored tensor's file, dtype and shape without reading data; `open_safetensors`/`get_tensor` read
memory-mapped tensors and name the file when that fails. Every problem is a `CheckpointError`.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from deepinfer.models.common.config_values import type_name
from deepinfer.models.common.errors import CheckpointError
from deepinfer.models.common.files import regular_file

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on the JSON header
DEFAULT_MAX_SHARD_BYTES = 2**30

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu, "F4": torch.float4_e2m1fn_x2,
}
# bits per stored value where it is not the torch dtype's (the header counts fp4 values, torch packs two)
SAFETENSORS_BITS = {"F4": 4}
# dtype codes of the safetensors format that deepinfer does not load (valid files, unsupported)
OTHER_SAFETENSORS_DTYPES = ("U16", "U32", "U64", "F6_E2M3", "F6_E3M2", "C64")


# --- config.json ---------------------------------------------------------------------------------

def read_config(path: str | Path) -> dict:
    """The checkpoint's `config.json` as a dict (FileNotFoundError in DeepInfer's wording if absent;
    CheckpointError if it is not a regular file, not JSON or not a JSON object)."""
    config_path = Path(path) / CONFIG_FILE
    if not regular_file(config_path, "the checkpoint's config.json"):
        raise FileNotFoundError(
            f"HF checkpoint requires config.json: {config_path} does not exist. Point the model path at "
            f"the folder that holds config.json and the *.safetensors files (or the download is incomplete).")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} must hold a JSON object with the model's settings (got "
                              f"{type_name(config)})")
    return config


# --- which files -----------------------------------------------------------------------------------

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
    regular_file(path, f"the shard (listed in {INDEX_FILE})")  # what it is first: a FIFO or /dev/zero is named
    return _inside(root, path, entry, "the shard")


def _inside(root: Path, path: Path, what: str, copy: str) -> Path:
    """`path`, refused when it resolves (through symlinks) outside the checkpoint folder (the
    Hugging Face cache's `blobs/` counts as inside, `_allowed_roots`)."""
    real = path.resolve()
    if not any(real.is_relative_to(r) for r in _allowed_roots(root)):
        raise CheckpointError(f"{what} is a symlink to {real}, outside the checkpoint folder {root.resolve()}; "
                              f"copy {copy} into the folder instead")
    return path


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards of the index, else `model.safetensors`. Index
    entries and the single file must stay inside the folder (no absolute paths, no `..`, no
    symlinks out), and every one must be a regular file (`regular_file`)."""
    root = Path(path)
    index = root / INDEX_FILE
    if regular_file(index, "the shard index"):
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (not JSON: {e})") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{index} is not a valid safetensors index: it must hold a JSON object with a "
                                  f"'weight_map' (got {type_name(data)})")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} is not a valid safetensors index: 'weight_map' must be an object of "
                                  f"tensor name -> shard file name (got {type_name(weight_map)})")
        files: dict[str, Path] = {}
        for tensor, name in weight_map.items():
            if not isinstance(name, str) or name not in files:
                files[name] = _shard_path(root, index, tensor, name)
        files_list = [files[name] for name in sorted(files)]
        absent = [f.name for f in files_list if not regular_file(f, f"the shard (listed in {INDEX_FILE})")]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that are not in {root}: {', '.join(absent)} "
                                    f"(incomplete download?)")
        return files_list
    single = root / SINGLE_FILE
    if regular_file(single, "the checkpoint file"):  # the index's containment rule applies to it too
        return [_inside(root, single, f"the checkpoint file {single}", SINGLE_FILE)]
    found = sorted(p.name for p in root.glob("*.safetensors"))
    hint = f" (found {', '.join(found)} but no {INDEX_FILE} listing them)" if found else ""
    raise FileNotFoundError(f"no weights in {root}: expected {SINGLE_FILE} or {INDEX_FILE}{hint}")


# --- one file's header -----------------------------------------------------------------------------

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
        raise corrupt(f"the header is not a JSON object (got {type_name(header)})")
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
        if code in OTHER_SAFETENSORS_DTYPES:
            raise CheckpointError(f"checkpoint file {file}: tensor {name} has dtype {code}, which deepinfer does not "
                                  f"load (supported: {', '.join(SAFETENSORS_DTYPES)})")
        if code not in SAFETENSORS_DTYPES:
            raise corrupt(f"tensor {name} has unsupported dtype {code!r} (not a safetensors dtype; supported: "
                          f"{', '.join(SAFETENSORS_DTYPES)})")
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
        bits = SAFETENSORS_BITS.get(code, SAFETENSORS_DTYPES[code].itemsize * 8)
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
class TensorEntry:
    """One stored tensor, from the file header (no data read)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]  # as torch will see it (packed FP4 counts bytes)


def read_headers(files: list[Path]) -> dict[str, TensorEntry]:
    """Every stored tensor of `files` (validated headers); a name stored twice is a CheckpointError."""
    entries: dict[str, TensorEntry] = {}
    for file in files:
        for name, (code, shape) in read_safetensors_header(file).items():
            if code == "F4":  # the header counts fp4 values; torch packs two per element
                shape = (*shape[:-1], shape[-1] // 2)
            if name in entries:
                raise CheckpointError(f"tensor {name} is stored twice ({entries[name].file.name}, {file.name})")
            entries[name] = TensorEntry(file, SAFETENSORS_DTYPES[code], shape)
    return entries


# --- reading data --------------------------------------------------------------------------------
# The headers were validated before (read_safetensors_header); a file that changed since, or that
# the library still refuses, is reported by name instead of as a bare SafetensorError.
READ_ERRORS = (SafetensorError, OSError, RuntimeError)


def unreadable(file: Path, what: str, e: Exception) -> CheckpointError:
    return CheckpointError(f"checkpoint file {file} could not be read ({what}; truncated or corrupt, or changed "
                           f"while loading?): {e}")


def open_safetensors(file: Path):
    """`safe_open` (memory-mapped, torch tensors) with a CheckpointError naming the file."""
    try:
        return safe_open(str(file), framework="pt")
    except READ_ERRORS as e:
        raise unreadable(file, "opening it", e) from None


def get_tensor(f, file: Path, name: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except READ_ERRORS as e:
        raise unreadable(file, f"tensor {name}", e) from None


# --- writing (test and random checkpoints) ---------------------------------------------------------

def _bytes_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                file=sys.stderr)


def write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      progress: bool = False) -> list[Path]:
    """One `model.safetensors`, or shards plus `model.safetensors.index.json` when larger."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    bar = _bytes_bar(sum(t.numel() * t.element_size() for t in tensors.values()), "writing safetensors", progress)
    for shard, file in zip(shards, names):
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        bar.update(sum(t.numel() * t.element_size() for t in shard.values()))
    bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {name: file for shard, file in zip(shards, names) for name in shard}}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return [out_dir / n for n in names]
