"""Write random-weight DeepSeek-V4 checkpoints (`deepinfer make-model --family v4`, the default).

The output is a directory transformers loads as it is (`DeepseekV4ForCausalLM.from_pretrained`, 0
missing and 0 unexpected keys): `config.json` in transformers' keys, safetensors with
transformers-internal names (fused experts), the MTP block under its official `mtp.0.*` names
(transformers ignores it; deepinfer loads it), a tokenizer, and `deepinfer_make_model.json`
recording how it was made. With `quantize=` it writes the official quantised hub format instead
(official names, FP8 e4m3 weights with ue8m0 `.scale` blocks, optionally FP4-packed experts), which
deepinfer's loader reads but transformers needs `accelerate` for.

Randomisation is deliberate: attention sinks, compressor position biases, mHC bases and scales,
router biases, hash tables and norm weights all get random values, because the usual initialisation
(zeros and ones) makes whole code paths invisible to tests. Each tensor is
drawn from its own generator seeded by (seed, name), so adding or dropping the MTP block leaves the
trunk's weights unchanged.

Sizes (see `SIZES`): `tiny` (vocab 512, about 0.6 M parameters: unit tests), `default` (the
embedded default model: hidden 256, 6 layers, the real 129,280-token vocabulary), `bench` (about
0.9 B parameters, the real vocabulary and attention hyperparameters, bf16: benchmarks on a CPU).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch

from deepinfer.models.common import quant
from deepinfer.models.common.safetensors_io import (  # noqa: F401  (write_safetensors re-exported)
    DEFAULT_MAX_SHARD_BYTES, _bytes_bar, write_safetensors,
)
from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config, YarnScaling
from deepinfer.models.deepseek_v4.weights import expected_weight_shapes, to_hf_names, weight_kind
from deepinfer.models.registry import CheckpointMaker

SPEC_VERSION = 1  # bump when a preset or the initialisation changes (invalidates cached default models)
MARKER_FILE = "deepinfer_make_model.json"
QUANTIZE_CHOICES = ("fp8", "fp4-experts")

SIZES: dict[str, dict[str, Any]] = {
    # the test model: every layer type, hash and learned routing, YaRN, index_topk 4 so the
    # indexer selects from 16 tokens on.
    "tiny": dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        layer_types=(SLIDING, CSA, HCA, CSA, HCA, SLIDING), csa_compress_rate=4, hca_compress_rate=16,
        index_n_heads=16, index_head_dim=16, index_topk=4,
        mlp_layer_types=("hash_moe",) * 2 + ("moe",) * 4, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=32,
        rope_scaling=YarnScaling(factor=16, original_max_position_embeddings=32), max_position_embeddings=512,
        num_nextn_predict_layers=1, dtype="float32"),
    # the embedded default model: real vocabulary, quick to create and to run on two cores
    "default": dict(
        vocab_size=129280, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=128, o_groups=2, o_lora_rank=64, sliding_window=32,
        layer_types=(SLIDING, CSA, HCA, CSA, HCA, SLIDING), csa_compress_rate=4, hca_compress_rate=32,
        index_n_heads=8, index_head_dim=32, index_topk=16,
        mlp_layer_types=("hash_moe",) * 2 + ("moe",) * 4, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=128,
        rope_scaling=YarnScaling(factor=16, original_max_position_embeddings=4096), max_position_embeddings=65536,
        num_nextn_predict_layers=1, dtype="bfloat16"),
    # ~0.9 B parameters (0.3 B of them embedding and head); V4-Flash's window, ratios, top-k and
    # layer schedule at a smaller width.
    "bench": dict(
        vocab_size=129280, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, head_dim=128,
        qk_rope_head_dim=32, q_lora_rank=384, o_groups=4, o_lora_rank=256, sliding_window=128,
        layer_types=(SLIDING, SLIDING) + (CSA, HCA) * 5, csa_compress_rate=4, hca_compress_rate=128,
        index_n_heads=16, index_head_dim=64, index_topk=512,
        mlp_layer_types=("hash_moe",) * 3 + ("moe",) * 9, n_routed_experts=32, num_experts_per_tok=4,
        n_shared_experts=1, moe_intermediate_size=512,
        rope_scaling=YarnScaling(factor=16, original_max_position_embeddings=65536),
        max_position_embeddings=1048576, num_nextn_predict_layers=1, dtype="bfloat16"),
}

# official tensors stored as FP8 blocks in the hub checkpoint (docs/checkpoints.md)
_FP8_RE = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|"
                     r"ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight$")
_EXPERT_RE = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_schedule(num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(layer_types, mlp_layer_types) for a layer count: sliding first and last, CSA/HCA alternating
    between, hash routing in the first two layers (at most n-1)."""
    if num_layers < 1:
        raise ValueError("num_hidden_layers must be >= 1")
    inner = [CSA if i % 2 == 0 else HCA for i in range(max(num_layers - 2, 0))]
    types = [SLIDING] + inner + ([SLIDING] if num_layers > 1 else [])
    n_hash = min(2, num_layers - 1)
    return tuple(types), ("hash_moe",) * n_hash + ("moe",) * (num_layers - n_hash)


def model_config(size: str = "tiny", **overrides: Any) -> tuple[DeepseekV4Config, torch.dtype]:
    """The config and storage dtype of a preset, with `DeepseekV4Config` field overrides.

    Overriding `num_hidden_layers` without `layer_types`/`mlp_layer_types` regenerates the schedule
    with `default_schedule`. `dtype` ("float32", "bfloat16", "float16") sets the storage dtype.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    fields = dict(SIZES[size])
    fields.update(overrides)
    if "num_hidden_layers" in overrides:
        types, mlp_types = default_schedule(int(overrides["num_hidden_layers"]))
        if "layer_types" not in overrides:
            fields["layer_types"] = types
        if "mlp_layer_types" not in overrides:
            fields["mlp_layer_types"] = mlp_types
    dtype_name = str(fields.pop("dtype"))
    if dtype_name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype_name!r}; choose from {', '.join(_DTYPES)}")
    if isinstance(fields.get("rope_scaling"), dict):
        fields["rope_scaling"] = YarnScaling(**fields["rope_scaling"])
    for key in ("layer_types", "mlp_layer_types"):
        fields[key] = tuple(fields[key])
    try:
        return DeepseekV4Config(**fields), _DTYPES[dtype_name]
    except Exception as e:  # pydantic's message names the field; add the valid keys for typos
        raise ValueError(f"invalid make-model settings for size {size!r}: {e}\nvalid keys: "
                         f"{', '.join(sorted(DeepseekV4Config.model_fields))}, dtype") from None


def count_parameters(config: DeepseekV4Config, with_mtp: bool = True) -> int:
    return sum(math.prod(s) for s in expected_weight_shapes(config, include_mtp=with_mtp).values())


# --- random values ---------------------------------------------------------------------------

def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def random_tensor(name: str, shape: tuple[int, ...], config: DeepseekV4Config, seed: int) -> torch.Tensor:
    """A random value for one official tensor (fp32, or int64 for `tid2eid`)."""
    g = _generator(seed, name)
    if name.rsplit(".", 1)[-1] == "tid2eid":  # distinct experts per token
        ranks = torch.rand(config.vocab_size, config.n_routed_experts, generator=g).argsort(dim=-1)
        return ranks[:, : config.num_experts_per_tok].contiguous()
    return initial_value(name, shape, g)


def initial_value(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """The fp32 random value of a float tensor by its name (the rules DeepSeek-V4.1's make-model
    shares): norms U(0.8, 1.2), sinks / position biases / mHC bases N(0, 0.5^2), mHC scales
    U(0.5, 1.5), mHC mixing matrices and linear weights N(0, 1/in), router biases N(0, 0.1^2), the
    embedding N(0, 1)."""
    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(shape, generator=g)

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return uniform(0.8, 1.2)
    if leaf == "attn_sink":
        return normal(0.5)
    if leaf == "ape":
        return normal(0.5)
    if leaf.endswith("_base"):  # mHC biases
        return normal(0.5)
    if leaf.endswith("_scale"):  # mHC scales
        return uniform(0.5, 1.5)
    if leaf.endswith("_fn"):  # mHC mixing matrices: unit-scale outputs
        return normal(shape[-1] ** -0.5)
    if name.endswith("gate.bias"):
        return normal(0.1)
    if name == "embed.weight":
        return normal(1.0)
    if len(shape) == 2:  # linear weights [out, in]: unit-scale outputs
        return normal(shape[1] ** -0.5)
    raise ValueError(f"no initialisation rule for {name} {shape}")


def random_weights(config: DeepseekV4Config, seed: int = 0, with_mtp: bool = True, dtype: torch.dtype = torch.float32,
                   progress: bool = False) -> dict[str, torch.Tensor]:
    """All official tensors of a config with random values: "float" tensors in `dtype`, "fp32"
    tensors (sinks, biases, mHC) in float32, `tid2eid` as int64."""
    shapes = expected_weight_shapes(config, include_mtp=with_mtp)
    out: dict[str, torch.Tensor] = {}
    bar = _bytes_bar(sum(math.prod(s) for s in shapes.values()) * dtype.itemsize, "generating weights", progress)
    for name, shape in shapes.items():
        t = random_tensor(name, shape, config, seed)
        kind = weight_kind(name)
        out[name] = t if kind == "int" else t.to(torch.float32 if kind == "fp32" else dtype)
        bar.update(math.prod(shape) * dtype.itemsize)
    bar.close()
    return out


def quantize_official(weights: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """Official hub format: FP8 blocks for the attention/shared-expert/MTP projections; routed
    experts FP8 (`mode="fp8"`) or packed FP4 (`mode="fp4-experts"`); ue8m0 `.scale` tensors;
    other floats in bf16 (fp32 where the official checkpoint keeps fp32); tid2eid int32."""
    if mode not in QUANTIZE_CHOICES:
        raise ValueError(f"unknown quantize mode {mode!r}; choose from {', '.join(QUANTIZE_CHOICES)}")
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        base = name[: -len(".weight")]
        if _EXPERT_RE.match(name) and mode == "fp4-experts":
            out[name], out[base + ".scale"] = quant.quantize_fp4(t)
        elif _FP8_RE.match(name) or _EXPERT_RE.match(name):
            out[name], out[base + ".scale"] = quant.quantize_fp8_block(t)
        elif weight_kind(name) == "int":
            out[name] = t.to(torch.int32)
        elif weight_kind(name) == "fp32":
            out[name] = t.to(torch.float32)
        else:
            out[name] = t.to(torch.bfloat16)
    return out


# --- writing ---------------------------------------------------------------------------------

def write_tokenizer(out_dir: Path, vocab_size: int) -> bool:
    """The real DeepSeek-V4 tokenizer when the vocabulary holds it, else a cut-down copy
    (`tokenizer.shrink_tokenizer_json`); False when the vocabulary is too small for either."""
    from deepinfer.tokenizer import default_tokenizer_path, shrink_tokenizer_json

    source = default_tokenizer_path()
    config_file = source.parent / "tokenizer_config.json"
    from tokenizers import Tokenizer

    if Tokenizer.from_file(str(source)).get_vocab_size() <= vocab_size:
        shutil.copyfile(source, out_dir / "tokenizer.json")
    else:
        try:
            data = shrink_tokenizer_json(source, vocab_size)
        except ValueError:
            return False
        (out_dir / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    if config_file.is_file():
        shutil.copyfile(config_file, out_dir / "tokenizer_config.json")
    return True


def empty_out_dir(out_dir: str | Path, overwrite: bool) -> Path:
    """`out_dir` (user-expanded), emptied when `overwrite`; FileExistsError when it holds files and
    `overwrite` is False."""
    out = Path(out_dir).expanduser()
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty; choose another directory or pass overwrite=True "
                                  f"(--force)")
        shutil.rmtree(out)
    return out


def make_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, with_mtp: bool = True,
               quantize: str | None = None, tokenizer: bool = True, overwrite: bool = False,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool | None = None,
               **overrides: Any) -> Path:
    """Write a random-weight DeepSeek-V4 checkpoint to `out_dir` and return its path.

    Args:
        size: a preset from `SIZES` ("tiny", "default", "bench").
        seed: random seed; the same arguments always give the same tensors.
        with_mtp: include the MTP block (`mtp.0.*`); without it config.json says
            `num_nextn_predict_layers: 0`.
        quantize: None (transformers' format, unquantised), "fp8" (official format, FP8 blocks
            everywhere the hub uses them plus FP8 routed experts) or "fp4-experts" (the V4-Flash
            hub format: FP8 blocks plus packed FP4 routed experts).
        tokenizer: write `tokenizer.json` (+ `tokenizer_config.json`).
        overwrite: replace an existing non-empty `out_dir`.
        max_shard_bytes: larger checkpoints are split into shards with an index.
        progress: show progress bars (None: only for checkpoints over 100 MB).
        **overrides: `DeepseekV4Config` fields (e.g. `num_hidden_layers=2`, `vocab_size=1024`) and
            `dtype` ("float32", "bfloat16") for the storage dtype of unquantised float tensors.
    """
    out = empty_out_dir(out_dir, overwrite)
    config, dtype = model_config(size, **overrides)
    if not with_mtp:
        config = config.model_copy(update={"num_nextn_predict_layers": 0})
    n_params = count_parameters(config, with_mtp)
    if progress is None:
        progress = n_params * dtype.itemsize > 100 * 2**20
    out.mkdir(parents=True, exist_ok=True)

    weights = random_weights(config, seed, with_mtp, dtype, progress)
    hf = config.to_hf_dict()
    hf["dtype"] = str(dtype).replace("torch.", "")
    if quantize is None:
        tensors = to_hf_names(weights)
    else:
        tensors = quantize_official(weights, quantize)
        hf["dtype"] = "bfloat16"
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
        hf["expert_dtype"] = "fp4" if quantize == "fp4-experts" else "fp8"
    del weights
    write_safetensors(tensors, out, max_shard_bytes, progress)
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    has_tokenizer = tokenizer and write_tokenizer(out, config.vocab_size)
    marker = {"made_by": "deepinfer make-model", "spec_version": SPEC_VERSION, "size": size, "seed": seed,
              "with_mtp": with_mtp, "quantize": quantize, "tokenizer": has_tokenizer, "parameters": n_params,
              "overrides": {k: (list(v) if isinstance(v, tuple) else v) for k, v in overrides.items()
                            if not isinstance(v, YarnScaling)}}
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2, default=str))
    return out


# --- command line ----------------------------------------------------------------------------

def _parse_size_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?i?b?)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 500MB, 2GB)")
    unit = (m.group(2) or "").lower().rstrip("b").rstrip("i")
    return int(float(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[unit])


def _parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set takes KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw  # bare strings such as dtype=bfloat16
    return key.strip(), value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """DeepSeek-V4's own `deepinfer make-model` flags (OUT_DIR, --family, --size, --seed and --force
    are the command's); their values reach `make_checkpoint` by `dest`."""
    parser.add_argument("--no-mtp", action="store_true", help="leave out the MTP block")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                        help="write the official quantised format (FP8 blocks; fp4-experts: FP4 routed experts)")
    parser.add_argument("--dtype", choices=list(_DTYPES), default=None, help="storage dtype of float weights")
    parser.add_argument("--no-tokenizer", action="store_true", help="do not write tokenizer.json")
    parser.add_argument("--set", dest="overrides", action="append", type=_parse_override, default=[],
                        metavar="KEY=VALUE", help="override a config field (JSON value), e.g. --set num_hidden_layers=2")
    parser.add_argument("--max-shard-size", type=_parse_size_bytes, default=DEFAULT_MAX_SHARD_BYTES,
                        help="split larger checkpoints into shards (default 1GiB)")


def make_checkpoint(out_dir: str | Path, size: str = "tiny", seed: int = 0, overwrite: bool = False, *,
                    no_mtp: bool = False, quantize: str | None = None, dtype: str | None = None,
                    no_tokenizer: bool = False, overrides: list[tuple[str, Any]] | None = None,
                    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """`deepinfer make-model --family deepseek_v4`: `make_model` with the command's flags (see
    `add_arguments`); returns the summary line the command prints."""
    fields = dict(overrides or [])
    if dtype:
        fields["dtype"] = dtype
    out = make_model(out_dir, size=size, seed=seed, with_mtp=not no_mtp, quantize=quantize,
                     tokenizer=not no_tokenizer, overwrite=overwrite, max_shard_bytes=max_shard_size, **fields)
    marker = json.loads((out / MARKER_FILE).read_text())
    disk = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return (f"wrote {out}: {size}, {marker['parameters']:,} parameters, {disk / 2**20:.1f} MiB of weights"
            f"{', quantised ' + quantize if quantize else ''}{', no MTP' if no_mtp else ''}"
            f"{'' if marker['tokenizer'] else ', no tokenizer'}")


#: the family's `ModelFamily.make_checkpoint` (`deepinfer make-model --family v4`)
CHECKPOINT_MAKER = CheckpointMaker(make=make_checkpoint, sizes=tuple(SIZES), add_arguments=add_arguments)
