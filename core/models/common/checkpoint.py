"""Loading a checkpoint folder's tensors, for any model family.

`SafetensorsCheckpoint(root)` lists and validates the files and headers (`safetensors_io`), then:

1. `plan(expert_dtype, keep_stored)` pairs every quantised weight with its scale (official
   `<w>.scale`, transformers' `<w>.weight_scale_inv` / `<fused>_scale_inv`) and checks the scale's
   shape (FP8 blocks of the folder's `block_size`: 128 unless the family passes its
   `quantization_config.weight_block_size`); weights `keep_stored` names stay as stored, their
   scale a tensor of its own (V4.1's memory-mapped Engram tables);
2. `loaded_shapes(units, rename, target_dtype, dtype)` runs the family's name canonicalisation on
   meta tensors: the loaded names, shapes and byte sizes, before any data is read;
3. `validate(expected, shapes)` compares them with what the config expects: one CheckpointError
   listing every missing, unexpected and mis-shaped tensor plus the problems found while planning;
4. `check_memory(loaded_bytes, dtype)` refuses a load that does not fit in RAM;
5. `load(units, rename, target_dtype, dtype, whole)` reads memory-mapped tensors one at a time,
   dequantises (fp32, exact, then one rounding), canonicalises and converts them, and refuses NaN
   and infinite values (`finite.py`: scales and the `whole` names read entirely, other tensors
   whole when small, at sampled rows when large).

`keep_quantized(formats, quantizable)` (before steps 2-5) keeps a quantised weight quantised instead:
when its format (`fp8_block<B>`, `fp4_e2m1`) is one of `formats` (the back end's
`Capabilities.weight_formats`) and every canonical piece it becomes is a name `quantizable` accepts
(the family's weights read only through linear / grouped_linear / moe_experts), it is loaded as a
`QuantizedWeight` per piece (weight and scale canonicalised alike, checked to fit each other; a
piece that does not fit, e.g. an FP8 fused expert split off a block boundary, dequantises the whole
stored tensor as before). Its size in the memory check is then its stored bytes.

`rename` is the family's canonicalisation `{stored name: tensor} -> {canonical name: tensor}` and
`target_dtype(name, dtype)` the dtype one canonical tensor is kept in.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from deepinfer.accelerator.quantized_weight import QuantizedWeight
from deepinfer.models.common import quant
from deepinfer.models.common.errors import CheckpointError, CheckpointTooLargeError
from deepinfer.models.common.finite import first_nonfinite, nonfinite_message
from deepinfer.models.common.safetensors_io import (
    CONFIG_FILE, TensorEntry, get_tensor, open_safetensors, read_config, read_headers, safetensors_files,
)

MAX_LISTED = 200  # problems listed per category in one error (the count is always exact)
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16}

Rename = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
TargetDtype = Callable[[str, torch.dtype], torch.dtype]
KeepStored = Callable[[str], bool]
Quantizable = Callable[[str], bool]  # canonical name -> may this weight stay quantised
ConfigT = TypeVar("ConfigT")


def keep_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The `target_dtype` of a family that loads every tensor in the requested dtype."""
    return dtype


# --- pairing quantised weights with their scales -----------------------------------------------

@dataclass(frozen=True)
class LoadUnit:
    """What becomes one (or, for fused experts, several) loaded tensors: a weight and its scale."""

    name: str
    scale_name: str | None


class LoadProblems:
    """Problems found while planning the load, reported together with the name checks."""

    def __init__(self) -> None:
        self.quant: list[str] = []
        self.duplicate: list[str] = []
        self.dtype: list[str] = []


def scale_candidates(name: str) -> list[str]:
    if name.endswith(".weight"):
        base = name[: -len(".weight")]
        return [base + ".scale", name + "_scale_inv"]  # official, transformers
    return [name + "_scale_inv", name + "_scale"]  # transformers' fused experts


def plan_units(entries: dict[str, TensorEntry], problems: LoadProblems, expert_dtype: str | None = None,
               block_size: int = quant.FP8_BLOCK, keep_stored: KeepStored | None = None) -> list[LoadUnit]:
    """One unit per stored tensor, quantised weights paired with their scales (which are then no
    units of their own). `expert_dtype = "fp8"` refuses packed FP4 weights; FP8 scales must cover
    `block_size` x `block_size` blocks. A weight for which `keep_stored(name)` holds is loaded as
    stored, and so is its scale (the family checks both)."""
    quantised = quant.FP8_DTYPES + quant.FP4_DTYPES
    units: list[LoadUnit] = []
    used_scales: set[str] = set()
    for name, entry in entries.items():
        scale = next((s for s in scale_candidates(name) if s in entries), None)
        if entry.dtype not in quantised or (keep_stored is not None and keep_stored(name)):
            units.append(LoadUnit(name, None))
            continue
        if scale is None:
            problems.quant.append(f"{name} ({entry.dtype}) has no scale tensor "
                                  f"(looked for {' or '.join(scale_candidates(name))})")
            continue
        used_scales.add(scale)
        if quant.quant_format(entry.dtype) == "fp4" and expert_dtype == "fp8":
            problems.quant.append(f"{name} is packed FP4 ({entry.dtype}) but config.json says expert_dtype 'fp8'")
            continue
        want = quant.expected_scale_shape(entry.shape, entry.dtype, block_size)
        if entries[scale].shape != want:
            problems.quant.append(f"{scale}: shape {entries[scale].shape} does not fit the "
                                  f"{quant.quant_format(entry.dtype)} weight {name} {entry.shape}; expected {want}")
            continue
        units.append(LoadUnit(name, scale))
    # drop the scales from the plain units; a scale-looking tensor without a quantised weight stays
    # (mHC `attn_hc.scale` and similar are real parameters) and is checked against the config.
    return [u for u in units if u.name not in used_scales]


# --- validation --------------------------------------------------------------------------------

def listing(title: str, items: list[str]) -> str:
    shown = items[:MAX_LISTED]
    more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"  {title} ({len(items)}):\n" + "\n".join(f"    {x}" for x in shown) + more


def compare_shapes(expected: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]]
                   ) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, wrong-shaped) names, sorted."""
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = sorted(k for k in set(shapes) & set(expected) if tuple(shapes[k]) != tuple(expected[k]))
    return missing, unexpected, wrong


def check_against(expected: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]], problems: LoadProblems,
                  path: Path, naming: str | None = None) -> None:
    """One CheckpointError listing every mismatch between the stored tensors (canonical names and
    loaded shapes) and what the config expects, plus the planning problems; nothing if all fit."""
    missing, unexpected, wrong = compare_shapes(expected, shapes)
    wrong_lines = sorted(f"{k}: checkpoint {shapes[k]}, config expects {expected[k]}" for k in wrong)
    sections = [(t, xs) for t, xs in (("missing tensors", missing), ("unexpected tensors", unexpected),
                                      ("tensors with the wrong shape", wrong_lines),
                                      ("quantisation problems", problems.quant),
                                      ("tensors stored under two names", problems.duplicate),
                                      ("tensors with the wrong dtype", problems.dtype)) if xs]
    if sections:
        body = "\n".join(listing(t, xs) for t, xs in sections)
        note = f" (names are shown in {naming} naming)" if naming else ""
        raise CheckpointError(
            f"checkpoint {path} does not match its config.json{note}:\n{body}\n"
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


def format_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_memory(loaded_bytes: int, disk_bytes: int, dtype: torch.dtype, path: Path,
                 smaller: str = "a smaller checkpoint") -> None:
    """CheckpointTooLargeError (a MemoryError) with both sizes and the fixes when the loaded tensors
    would not fit in the RAM available now."""
    available = available_memory_bytes()
    if loaded_bytes > available:
        raise CheckpointTooLargeError(
            f"checkpoint {path} needs about {format_bytes(loaded_bytes)} of RAM once loaded as {dtype_name(dtype)} "
            f"({format_bytes(disk_bytes)} on disk; quantised FP8/FP4 weights the back end does not compute on are "
            f"dequantised on load), but only "
            f"{format_bytes(available)} is available. Fix: free memory or use a machine with more RAM, load in "
            f"bfloat16 if you asked for float32, or use {smaller}.")


# --- dtypes --------------------------------------------------------------------------------------

def resolve_dtype(dtype: torch.dtype | str | None, entries: dict[str, TensorEntry] | None = None,
                  reference_names: tuple[str, ...] = ()) -> torch.dtype:
    """A torch float dtype from a dtype or its name; "auto"/None picks the checkpoint's float dtype
    (that of the first of `reference_names` stored, e.g. the embedding; else bfloat16, as for
    quantised checkpoints)."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise ValueError(f"load dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if dtype in (None, "auto"):
        if entries:
            for name in reference_names:
                if name in entries and entries[name].dtype in (torch.float32, torch.bfloat16, torch.float16):
                    return entries[name].dtype
        return torch.bfloat16
    if isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower()]
    raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16, float16 or auto")


# --- the folder ----------------------------------------------------------------------------------

def checkpoint_config(path: str | Path, config_dict: dict | None, parse: Callable[[dict, str], ConfigT]
                      ) -> tuple[Path, ConfigT]:
    """(folder, parsed config) of a checkpoint folder: FileNotFoundError when the folder is missing;
    `config_dict` is its config.json when the caller has read it already, else it is read here
    (`read_config`) and parsed with the family's `parse(config_dict, source)`."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {root}")
    if config_dict is None:
        config_dict = read_config(root)
    return root, parse(config_dict, str(root / CONFIG_FILE))


class SafetensorsCheckpoint:
    """A checkpoint folder's safetensors, headers read and validated, no tensor data read yet."""

    def __init__(self, root: str | Path, block_size: int = quant.FP8_BLOCK):
        self.root = Path(root)
        self.block_size = block_size  # rows and columns per FP8 scale block
        self.files = safetensors_files(self.root)
        self.entries = read_headers(self.files)
        self.problems = LoadProblems()
        self.weight_formats: tuple[str, ...] = ()  # formats kept quantised (keep_quantized)
        self.quantizable: Quantizable | None = None

    def keep_quantized(self, formats: tuple[str, ...], quantizable: Quantizable) -> None:
        """Keep the quantised weights of `formats` whose canonical names `quantizable` accepts as
        `QuantizedWeight`s (see the module docstring); call before `loaded_shapes` and `load`."""
        self.weight_formats, self.quantizable = tuple(formats), quantizable

    def _kept(self, unit: LoadUnit, weight: torch.Tensor, scale: torch.Tensor, rename: Rename,
              target_dtype: TargetDtype, dtype: torch.dtype) -> dict[str, QuantizedWeight] | None:
        """The unit's canonical pieces as QuantizedWeights, or None when it is to be dequantised (its
        format not kept, a piece not quantizable, or a piece's scale not fitting it). Works on meta
        tensors too (the shapes pass)."""
        if (unit.scale_name is None or self.quantizable is None
                or quant.format_name(weight.dtype, self.block_size) not in self.weight_formats):
            return None
        pieces, scales = rename({unit.name: weight}), rename({unit.scale_name: scale})
        out: dict[str, QuantizedWeight] = {}
        for name, piece in pieces.items():
            scale_name = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
            if scale_name not in scales or not self.quantizable(name):
                return None
            try:
                out[name] = QuantizedWeight(piece, scales[scale_name], self.block_size, target_dtype(name, dtype))
            except ValueError:
                return None
        return out if len(out) == len(scales) else None

    @property
    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def plan(self, expert_dtype: str | None = None, keep_stored: KeepStored | None = None) -> list[LoadUnit]:
        return plan_units(self.entries, self.problems, expert_dtype, self.block_size, keep_stored)

    def _meta(self, unit: LoadUnit) -> torch.Tensor:
        e = self.entries[unit.name]
        if unit.scale_name is None:
            return torch.empty(e.shape, dtype=e.dtype, device="meta")
        return torch.empty(quant.dequantized_shape(e.shape, e.dtype), dtype=torch.float32, device="meta")

    def loaded_shapes(self, units: list[LoadUnit], rename: Rename, target_dtype: TargetDtype, dtype: torch.dtype
                      ) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
        """({canonical name: shape}, {canonical name: loaded bytes}) from the headers alone; two stored
        tensors that land on one canonical name are recorded as problems."""
        shapes: dict[str, tuple[int, ...]] = {}
        sizes: dict[str, int] = {}
        sources: dict[str, str] = {}
        for unit in units:
            try:
                kept = None
                if unit.scale_name is not None:
                    w, s = (self.entries[n] for n in (unit.name, unit.scale_name))
                    kept = self._kept(unit, torch.empty(w.shape, dtype=w.dtype, device="meta"),
                                      torch.empty(s.shape, dtype=s.dtype, device="meta"), rename, target_dtype, dtype)
                pieces = kept if kept is not None else rename({unit.name: self._meta(unit)})
            except ValueError as e:
                self.problems.duplicate.append(f"{unit.name}: {e}")
                continue
            for name, t in pieces.items():
                if name in shapes:
                    self.problems.duplicate.append(f"{name}: from {sources[name]} and {unit.name}")
                    continue
                shapes[name], sources[name] = tuple(t.shape), unit.name
                sizes[name] = t.nbytes if kept is not None else t.numel() * target_dtype(name, dtype).itemsize
        return shapes, sizes

    def validate(self, expected: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]],
                 naming: str | None = None) -> None:
        check_against(expected, shapes, self.problems, self.root, naming)

    def check_memory(self, loaded_bytes: int, dtype: torch.dtype, smaller: str = "a smaller checkpoint") -> None:
        check_memory(loaded_bytes, self.disk_bytes, dtype, self.root, smaller)

    def iter_loaded(self, units: list[LoadUnit], rename: Rename, target_dtype: TargetDtype, dtype: torch.dtype,
                    whole: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(canonical name, tensor) for every unit, reading files through memory maps. Every tensor
        is checked for NaN and infinite values (`finite.first_nonfinite`): the scales of quantised
        weights and the canonical names in `whole` entirely, the others whole when small and at
        sampled rows when large; one found is a CheckpointError naming the tensor and its file."""
        entries = self.entries
        by_file: dict[Path, list[LoadUnit]] = {}
        for u in units:
            by_file.setdefault(entries[u.name].file, []).append(u)
        for file, file_units in by_file.items():
            with open_safetensors(file) as f:
                for u in file_units:
                    tensor = get_tensor(f, file, u.name)
                    if u.scale_name is not None:
                        scale_file = entries[u.scale_name].file
                        if scale_file == file:
                            scale = get_tensor(f, file, u.scale_name)
                        else:
                            with open_safetensors(scale_file) as g:
                                scale = get_tensor(g, scale_file, u.scale_name)
                        _check_finite(u.scale_name, scale_file, scale, whole=True)
                        kept = self._kept(u, tensor, scale, rename, target_dtype, dtype)
                        if kept is not None:  # memory-mapped views; the model copies them
                            _check_finite(u.name, file, tensor)  # the FP8 codes (FP4 has no NaN)
                            yield from kept.items()
                            continue
                        # dequantise in fp32 (exact), then round once to the target dtype below
                        tensor = quant.dequantize(tensor, scale, torch.float32, self.block_size)
                    for name, piece in rename({u.name: tensor}).items():
                        piece = piece.to(target_dtype(name, dtype)).contiguous()
                        _check_finite(u.name if name == u.name else f"{u.name} (loaded as {name})", file, piece,
                                      whole=name in whole)
                        yield name, piece

    def load(self, units: list[LoadUnit], rename: Rename, target_dtype: TargetDtype, dtype: torch.dtype,
             whole: Collection[str] = ()) -> dict[str, torch.Tensor | QuantizedWeight]:
        return dict(self.iter_loaded(units, rename, target_dtype, dtype, whole))


def _check_finite(name: str, file: Path, tensor: torch.Tensor, whole: bool = False) -> None:
    index = first_nonfinite(tensor, whole)
    if index is not None:
        raise CheckpointError(nonfinite_message(name, file, index, tensor))
