"""NVIDIA NeMo AutoModel's DeepSeek-V4.1 as an independent oracle, on CPU in float32.

`build_nemo_model(checkpoint_dir)` builds NeMo's `DeepseekV41ForCausalLM` from a checkpoint folder in
the release layout (what `deepinfer make-model --family v41` writes) and loads its weights through
NeMo's own state-dict adapter (its own dequantisation and renaming), strictly: a missing or
unexpected key fails. nemo_automodel is imported only when a function is called (it is a test and
training dependency, installed `--no-deps` by scripts/setup_env.sh, never a run-time one). Tests that
use it skip when it is not installed; the demo model's trainer (scripts/train_demo_model.py) builds
its model with `nemo_config` too.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

TOKENIZER = Path("tokenizer") / "tokenizer.json"

# NeMo compiles its expert activations with torch.compile (inductor, max_autotune). The oracle runs
# them eagerly: inductor's generated CPU kernels are cached on disk across processes, and with the
# suite run per CPU tier (ATEN_CPU_CAPABILITY=avx2 after a native run) NeMo's logits came out NaN,
# or the process aborted inside the compiler. deepinfer itself compiles nothing, so this process-wide
# stance changes only the oracle, and eager is the plain math the comparison wants anyway.
torch.compiler.set_stance("force_eager")


def nemo_config(checkpoint_dir: str | Path, vision: bool = False):
    """NeMo's `DeepseekV41Config` from the folder's config.json: text model in float32, with the
    folder's vision tower when `vision`, else none."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    data = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    data["text_config"] = {**data["text_config"], "dtype": "float32"}
    if vision:
        data["dtype"] = "float32"
    else:
        data["vision_config"] = {"num_hidden_layers": 0}
    data.pop("model_type", None)
    return DeepseekV41Config(**data)


def fast_tokenizer(tokenizer_json: str | Path):
    """A `tokenizer.json` as the transformers fast tokenizer NeMo's Engram hashing takes."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))


def nemo_tokenizer(checkpoint_dir: str | Path):
    """The checkpoint's own tokenizer (`tokenizer/tokenizer.json`) as a fast tokenizer."""
    return fast_tokenizer(Path(checkpoint_dir) / TOKENIZER)


def read_release_tensors(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of the folder's safetensors files, as stored (official names)."""
    from safetensors.torch import load_file

    root = Path(checkpoint_dir)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def nemo_backend(attn: str = "eager"):
    """NeMo's torch back ends on the CPU (`attn`: "eager" for the oracle, "sdpa" for training)."""
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(attn=attn, linear="torch", rms_norm="torch_fp32", rope_fusion=False, experts="torch",
                         dispatcher="torch", gate_precision="float32", enable_hf_state_dict_adapter=True)


def build_nemo_model(checkpoint_dir: str | Path, vision: bool = False, attn: str = "eager") -> torch.nn.Module:
    """NeMo's V4.1 model (eval mode, CPU, float32, torch backends) with the checkpoint's weights
    loaded through NeMo's state-dict adapter and `load_state_dict(strict=True)` (with the vision
    tower when `vision`; without it the checkpoint's vision tensors are left out)."""
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    model = DeepseekV41ForCausalLM(nemo_config(checkpoint_dir, vision), backend=nemo_backend(attn),
                                   tokenizer=nemo_tokenizer(checkpoint_dir))
    model.initialize_weights(dtype=torch.float32)
    tensors = read_release_tensors(checkpoint_dir)
    if not vision:
        tensors = {k: v for k, v in tensors.items() if not k.startswith(("vision.", "aligner.", "image_"))}
    converted = model.state_dict_adapter.from_hf(tensors)
    model.load_state_dict(converted, strict=True)
    return model.eval()


def nemo_vision(checkpoint_dir: str | Path):
    """NeMo's vision transformer and aligner (float32) with the checkpoint's `vision.*` /
    `aligner.*` tensors loaded strictly, and its three delimiter vectors by name."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.vision import (
        DeepseekV41VisionAligner, DeepseekV41VisionTransformer,
    )

    data = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    data.pop("model_type", None)
    config = DeepseekV41Config(**{**data, "dtype": "float32"})
    tensors = {k: v.float() for k, v in read_release_tensors(checkpoint_dir).items()}
    vit, aligner = DeepseekV41VisionTransformer(config), DeepseekV41VisionAligner(config)
    for module, prefix in ((vit, "vision."), (aligner, "aligner.")):
        module.load_state_dict({k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)},
                               strict=True)
        module.float().eval()
    delimiters = {k: tensors[k] for k in ("image_start", "image_newline", "image_end")}
    return vit, aligner, delimiters
