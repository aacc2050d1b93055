"""Engine configuration: one pydantic model, three sources.

Precedence (highest first): explicit arguments (`LLM(...)`, command-line flags) > environment
variables (`envs.py`) > the TOML file (`--config` / `DEEPINFER_CONFIG`) > defaults. Feature
settings live under `[features.<name>]` and are validated against that feature's own model once
the feature plugins are loaded (`resolve_feature_configs`).
"""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deepinfer import envs


# Upper bounds of the settings that size work and memory (far above what one engine runs; the model
# families bound their own settings alike, models/common/config_values.py).
MAX_TOKENS = 1 << 24  # max_model_len, max_num_batched_tokens (a model's max_position_embeddings is at most this)
MAX_SEQS = 1 << 16  # max_num_seqs
MAX_BLOCK_SIZE = 1 << 16  # compressed entries per cache block
MAX_RANKS = 4096  # ep, dp, cp
MAX_VOCAB = 1 << 22  # sampler_force_topk (at most a vocabulary)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str | None = Field(None, description="checkpoint directory or HF id (local cache); None: the default model")
    tokenizer: str | None = Field(None, description="tokenizer.json path; None: the checkpoint's, else DeepSeek-V4's")
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    max_model_len: int | None = Field(None, ge=2, le=MAX_TOKENS,
                                      description="prompt + output tokens per request; None: min(model limit, 32768)")
    max_num_seqs: int = Field(64, ge=1, le=MAX_SEQS, description="sequences in one step")
    max_num_batched_tokens: int = Field(8192, ge=1, le=MAX_TOKENS,
                                        description="tokens in one step (prefill chunks + decode)")
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0,
                                          description="fraction of device memory (RAM on CPU) for weights plus cache")
    cache_memory_gb: float | None = Field(None, gt=0.0, allow_inf_nan=False,
                                          description="explicit cache size; overrides gpu_memory_utilization")
    block_size: int = Field(64, ge=1, le=MAX_BLOCK_SIZE, description="compressed entries per cache block")
    seed: int = Field(0, ge=0, lt=2**64, description="seed of the engine's shared sampling generator")
    accelerator: str | None = Field(None, description="back-end plugin name; None: auto (see DEEPINFER_ACCELERATOR)")
    ep: int = Field(1, ge=1, le=MAX_RANKS)
    dp: int = Field(1, ge=1, le=MAX_RANKS)
    cp: int = Field(1, ge=1, le=MAX_RANKS)
    async_pipeline: bool | None = Field(
        None, description="prepare step N+1 on the host while step N runs; None (auto): on where the back end "
                          "declares host_overlap (GPU, NPU), off on the cpu back end")
    sampler_force_topk: int | None = Field(None, ge=1, le=MAX_VOCAB,
                                           description="restrict sampling to the top-k logits first")
    model_options: dict[str, Any] = Field(
        default_factory=dict, description="[model_options]: overrides of the model family's options "
                                          "(OpDefaults.model_options, e.g. DeepSeek-V4's query_block), checked "
                                          "against the options the family declares once the checkpoint is known")
    features: dict[str, dict[str, Any]] = Field(default_factory=dict, description="[features.<name>] tables")

    @field_validator("model")
    @classmethod
    def _model_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("model is an empty string; give a checkpoint directory or a Hugging Face id, or leave "
                             "it unset (None) for the default model")
        return value

    @model_validator(mode="after")
    def _parallel_sizes(self) -> EngineConfig:
        world = self.dp * self.cp
        if world % self.ep:
            raise ValueError(f"world size dp*cp = {self.dp}*{self.cp} = {world} must be divisible by ep={self.ep}")
        return self


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid engine configuration ({source}):"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = f"unknown key; valid keys: {', '.join(sorted(EngineConfig.model_fields))}"
        elif "input" in e and not isinstance(e["input"], dict):
            shown = repr(e["input"])
            msg = f"{msg} (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)


def read_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {p} (from --config or DEEPINFER_CONFIG)")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {p} is not valid TOML: {e}") from None


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(explicit: dict[str, Any] | None = None, config_file: str | Path | None = None) -> EngineConfig:
    """Build the engine config from file < environment < explicit arguments (None values skipped)."""
    layers: list[tuple[str, dict]] = []
    path = config_file or envs.get("DEEPINFER_CONFIG")
    if path:
        layers.append((f"file {path}", read_toml(path)))
    layers.append(("environment", envs.engine_overrides()))
    layers.append(("arguments", {k: v for k, v in (explicit or {}).items() if v is not None}))
    merged: dict = {}
    for _, layer in layers:
        merged = _merge(merged, layer)
    try:
        return EngineConfig(**merged)
    except ValidationError as err:
        sources = ", ".join(name for name, layer in layers if layer)
        raise ValueError(_format_error(err, sources or "defaults")) from None


def resolve_feature_configs(config: EngineConfig, feature_models: dict[str, type[BaseModel]]) -> dict[str, BaseModel]:
    """Validate each enabled feature's table against its own model; environment variables that
    configure a feature are merged in (and rejected when the feature is not installed).

    A feature is enabled when it has a table in `config.features` or an environment variable that
    turns it on (`EnvVar.enables_feature`).
    Every problem is reported at once.
    """
    tables = _merge(config.features, envs.feature_overrides(set(feature_models), set(config.features)))
    problems, out = [], {}
    for name, table in tables.items():
        model = feature_models.get(name)
        if model is None:
            problems.append(f"  features.{name}: unknown feature; installed: {', '.join(sorted(feature_models)) or 'none'}")
            continue
        try:
            out[name] = model(**table)
        except ValidationError as err:
            for e in err.errors():
                where = ".".join(str(p) for p in e["loc"])
                msg = e["msg"] if e["type"] != "extra_forbidden" else \
                    f"unknown key; valid keys: {', '.join(sorted(model.model_fields))}"
                problems.append(f"  features.{name}.{where}: {msg}")
    if problems:
        raise ValueError("invalid feature configuration:\n" + "\n".join(problems))
    return out
