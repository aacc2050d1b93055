"""Build an `EngineCore` from an `EngineConfig`: back end, checkpoint, model, tokenizer, cache pool, features.

The model family comes from the checkpoint's config.json `model_type` through the model registry
(`deepinfer.models.registry`): its parser, checkpoint loader, model class and op defaults (the
model options, overridden by `EngineConfig.model_options`). Nothing here knows a particular model;
the engine talks to it through the `Model` protocol.

Memory budget (`gpu_memory_utilization`, default 0.85): the fraction of the memory the back end
reports free at start-up (`accelerator.memory_info()`: device memory on a GPU, available RAM on the
CPU) that weights, activations and the cache may take together; the cache gets what is left after
the loaded weights and an activation reserve. `cache_memory_gb` replaces that computation with an
explicit cache size. Either way the pool is never larger than `max_num_seqs` sequences of
`max_model_len` tokens can use, and a budget too small for one such sequence is a start-up error
that says how much is needed.
"""
from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepinfer import envs
from deepinfer.accelerator.quantized_weight import weight_nbytes
from deepinfer.config import EngineConfig
from deepinfer.engine.cache_manager import GiB, CacheManager, PoolSize, size_pool
from deepinfer.engine.engine_core import EngineCore
from deepinfer.parallel.context_parallel import current_context_parallel
from deepinfer.parallel.expert_parallel import current_expert_parallel, current_layout

if TYPE_CHECKING:
    from deepinfer.models.registry import ModelFamily

logger = logging.getLogger("deepinfer")

DEFAULT_MAX_MODEL_LEN = 32768


@dataclass
class BuildInfo:
    model_path: str
    model_source: str  # "local", "hf-cache", "env", "default"
    is_default_model: bool
    dtype: torch.dtype
    weight_bytes: int
    pool: PoolSize
    load_seconds: float
    cache_seconds: float
    model_type: str = ""  # config.json's model_type: the registry family that serves it


def _dtype(config: EngineConfig) -> str | None:
    return None if config.dtype == "auto" else config.dtype


def cache_budget(config: EngineConfig, free_bytes: int, weight_bytes: int, reserve_bytes: int) -> int:
    if config.cache_memory_gb is not None:
        budget = int(config.cache_memory_gb * GiB)
        if budget > free_bytes - weight_bytes:
            raise ValueError(
                f"cache_memory_gb={config.cache_memory_gb} is more than this machine can hold: the back end reports "
                f"{free_bytes / GiB:.2f} GiB free and the weights take {weight_bytes / GiB:.2f} GiB. Lower "
                f"cache_memory_gb, or leave it unset so that gpu_memory_utilization sizes the cache.")
        return budget
    budget = int(config.gpu_memory_utilization * free_bytes) - weight_bytes - reserve_bytes
    if budget <= 0:
        raise ValueError(
            f"no memory is left for the cache: gpu_memory_utilization={config.gpu_memory_utilization} of "
            f"{free_bytes / GiB:.2f} GiB free is {config.gpu_memory_utilization * free_bytes / GiB:.2f} GiB, but the "
            f"weights take {weight_bytes / GiB:.2f} GiB and activations about {reserve_bytes / GiB:.2f} GiB. "
            f"Raise gpu_memory_utilization, set cache_memory_gb explicitly, or lower max_num_batched_tokens.")
    return budget


def load_family_checkpoint(family: ModelFamily, path: str | Path, dtype: str | torch.dtype | None, config_dict: dict,
                           weight_formats: tuple[str, ...]) -> tuple[Any, dict[str, Any]]:
    """`family.load_checkpoint(path, dtype, config_dict)`, passing the back end's quantised weight
    formats (`Capabilities.weight_formats`) on as `weight_formats=` when there are any and the loader
    takes that keyword (the in-tree families do); a loader without it dequantises everything, which
    every back end accepts."""
    if weight_formats and "weight_formats" in inspect.signature(family.load_checkpoint).parameters:
        return family.load_checkpoint(path, dtype, config_dict, weight_formats=tuple(weight_formats))
    return family.load_checkpoint(path, dtype, config_dict)


def check_parallel_layout(config: EngineConfig) -> None:
    """ep/dp/cp other than 1 need the process this engine runs in to be a rank of that launch
    (`deepinfer.parallel.launch`), which installs the groups the model shards over."""
    if config.ep * config.dp * config.cp == 1:
        return
    layout = current_layout()
    if layout is None or (layout.ep, layout.dp, layout.cp) != (config.ep, config.dp, config.cp):
        where = "outside a parallel launch" if layout is None else f"in a launch of {layout.describe()}"
        raise ValueError(f"ep={config.ep}, dp={config.dp}, cp={config.cp} requested {where}: start one process per "
                         f"rank with deepinfer.parallel.launch (examples/offline_inference.py --ep/--dp does), or "
                         f"use ep = dp = cp = 1 in a single process")


def check_context_parallel(family: ModelFamily, cp: int) -> None:
    """cp > 1 needs a model class that splits its prefills over the CP group
    (`supports_context_parallel`); others are refused with their `context_parallel_unsupported`
    reason when they give one."""
    if cp == 1 or getattr(family.model_class, "supports_context_parallel", False):
        return
    reason = getattr(family.model_class, "context_parallel_unsupported", None) or \
        "its model class does not implement it"
    raise ValueError(f"context parallelism (--cp {cp}) is not available for {family.model_type}: {reason}; "
                     f"use --cp 1")


def build_engine(config: EngineConfig) -> tuple[EngineCore, BuildInfo]:
    """Build the engine for `config`. Settings left on auto are resolved here; the returned engine's
    `config` holds the resolved values."""
    from deepinfer.models.interface import allocate_cache_tensors
    from deepinfer.models.registry import checkpoint_family
    from deepinfer.models.resolve import resolve_model
    from deepinfer.plugins import load_features, select_accelerator
    from deepinfer.tokenizer import load_tokenizer

    envs.warn_unknown()
    envs.check_values()
    check_parallel_layout(config)
    accelerator = select_accelerator(config.accelerator)
    device = accelerator.device(0)
    if current_expert_parallel() is not None or current_context_parallel() is not None:
        # the collectives must come from one thread: the EP idle lockstep runs on the caller's
        if config.async_pipeline:
            logger.warning("async_pipeline = true is ignored under expert or context parallelism (ep=%d, cp=%d): "
                           "the collectives must be issued from one thread, so steps run synchronously",
                           config.ep, config.cp)
        config = config.model_copy(update={"async_pipeline": False})
    if config.async_pipeline is None:
        config = config.model_copy(update={"async_pipeline": accelerator.capabilities().host_overlap})
    free_bytes = accelerator.memory_info().free_bytes  # before the weights are loaded

    t0 = time.perf_counter()
    resolved = resolve_model(config.model)
    family, config_dict = checkpoint_family(resolved.path)  # config.json's model_type -> the registry entry
    family.check_accelerator(accelerator)  # every kernel the model calls, before any weight is read
    check_context_parallel(family, config.cp)
    model_options = family.model_options(config.model_options)  # unknown keys fail before loading too
    model_config, weights = load_family_checkpoint(family, resolved.path, _dtype(config), config_dict,
                                                   accelerator.capabilities().weight_formats)
    # the compute dtype: the half-precision weights' (tables kept quantised, e.g. FP8, do not count;
    # a QuantizedWeight's dtype is the one it stands for)
    float_dtypes = [t.dtype for t in weights.values() if t.dtype in (torch.bfloat16, torch.float16)]
    dtype = float_dtypes[0] if float_dtypes else torch.float32
    weight_bytes = sum(weight_nbytes(t) for t in weights.values())
    model = family.build_model(model_config, accelerator, dtype, device, **model_options)
    model.load_weights(weights)
    del weights
    load_seconds = time.perf_counter() - t0

    eos = model_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (tuple, list)) else [] if eos is None else [eos])
    tokenizer = load_tokenizer(resolved.path, config.tokenizer, vocab_size=model_config.vocab_size,
                               bos_token_id=model_config.bos_token_id,
                               eos_token_id=next(iter(sorted(eos_ids)), None))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos_ids.add(tokenizer.eos_token_id)

    limit = model_config.max_position_embeddings
    max_model_len = config.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")

    features = load_features(config, accelerator)
    t1 = time.perf_counter()
    # a feature that drops positions after writing them (speculative decoding: rejected drafts)
    # declares how many through its config's `max_rollback`; the rings are sized for it
    max_rollback = max((getattr(c, "max_rollback", 0) for c in features.configs.values()), default=0)
    layout = model.cache_layout(max_rollback)
    reserve = family.activation_reserve_bytes(model_config, config.max_num_batched_tokens, config.max_num_seqs)
    budget = cache_budget(config, free_bytes, weight_bytes, reserve)
    if current_context_parallel() is not None:  # the CP ranks must schedule alike: one pool size for all
        budget = current_context_parallel().smallest(budget)
    pool = size_pool(layout, budget_bytes=budget, max_model_len=max_model_len,
                     max_num_seqs=config.max_num_seqs, block_size=config.block_size)
    tensors = allocate_cache_tensors(layout, pool.num_slots, pool.num_blocks, pool.block_size, device)
    model.bind_cache(tensors)
    accelerator.prepare_memory()  # weights and cache in place: the back end may advise their pages
    cache = CacheManager(layout, pool.num_slots, pool.num_blocks, pool.block_size, tensors=tensors)
    cache_seconds = time.perf_counter() - t1
    logger.info("cache pool: %d slots, blocks %s (%.3f GiB) in %.2f s", pool.num_slots, pool.num_blocks,
                pool.total_bytes / GiB, cache_seconds)

    engine = EngineCore(
        model=model, accelerator=accelerator, tokenizer=tokenizer, cache=cache, max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        vocab_size=model_config.vocab_size, eos_token_ids=eos_ids, device=device,
        async_pipeline=config.async_pipeline, sampler_force_topk=config.sampler_force_topk, seed=config.seed,
        features=features, config=config)
    info = BuildInfo(model_path=str(resolved.path), model_source=resolved.source,
                     is_default_model=resolved.is_default, dtype=dtype, weight_bytes=weight_bytes, pool=pool,
                     load_seconds=load_seconds, cache_seconds=cache_seconds,
                     model_type=family.model_type)
    return engine, info
