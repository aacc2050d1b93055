"""Prefix cache for compressed caches: reuse the model state of prompt prefixes seen before.

Enable it with DEEPINFER_PREFIX_CACHE=1, a `[features.prefix_cache]` table, or `deepinfer serve
--prefix-cache` (docs/server.md, "Prefix cache"). Multi-turn chat and agents re-send the whole
conversation each turn; with the cache, a request starts after the longest prefix of its tokens
whose state a previous request left at a block boundary (a multiple of `block_tokens`, itself a
multiple of every compression ratio), and only the rest is prefilled.

What a block holds and why a hit is exact is in `store.py`; persistence (`dir`) in `persist.py`.
The core side is `CacheManager.attach_prefix_cache` and the scheduler (cache_manager.py,
scheduler.py): this plugin attaches its store when the engine starts and writes it to disk at
shutdown. Sampling seeds and structured outputs need nothing special: the cache holds model state
only, and a hit's logits equal a miss's (in fp32 up to the last bits of a differently chunked
prefill; with batch_invariant, the same bits).

Refused together with speculative decoding (dspark: its drafter's per-request context is not part
of the snapshot) and SWA bounded replay (swa_replay: its approximate prefill depends on where a
prompt's prefill starts).

This module stays import-light: the entry point imports it to read the FeatureSpec.
"""
from __future__ import annotations

import logging
import math

from deepinfer.envs import EnvVar
from deepinfer.features import FeatureSpec
from deepinfer.hookspecs import EngineContext, hookimpl
from deepinfer.models.interface import CacheLayout

from .config import DEFAULT_MIN_BLOCK_TOKENS, PrefixCacheConfig

logger = logging.getLogger("deepinfer")

NAME = "prefix_cache"
ENV_VAR = "DEEPINFER_PREFIX_CACHE"
DIR_VAR = "DEEPINFER_PREFIX_CACHE_DIR"
MB_VAR = "DEEPINFER_PREFIX_CACHE_MB"
BLOCK_VAR = "DEEPINFER_PREFIX_CACHE_BLOCK_TOKENS"


def default_block_tokens(layout: CacheLayout) -> int:
    """The smallest multiple of every compression ratio that is at least DEFAULT_MIN_BLOCK_TOKENS."""
    step = math.lcm(*[g.tokens_per_entry for g in layout.block_groups]) if layout.block_groups else 1
    return step * -(-DEFAULT_MIN_BLOCK_TOKENS // step)


class PrefixCachePlugin:
    """The feature plugin (entry point `deepinfer.features:prefix_cache`): one instance per engine,
    holding that engine's prefix store."""

    def __init__(self, config: PrefixCacheConfig) -> None:
        self.config = config
        self.store = None
        self.disk = None

    @staticmethod
    @hookimpl
    def deepinfer_feature_spec() -> FeatureSpec:
        return FeatureSpec(
            name=NAME,
            config_model=PrefixCacheConfig,
            hooks=("deepinfer_feature_spec", "deepinfer_engine_start", "deepinfer_engine_shutdown"),
            env_vars=(
                EnvVar(ENV_VAR, "1: reuse the model state of cached prompt prefixes (prefix cache); 0: off.",
                       field="enabled", kind=bool),
                EnvVar(DIR_VAR, "prefix cache: persist it in this directory (loaded at start, written at shutdown; "
                                "created 0700 and refused unless it is yours and writable by nobody else).",
                       field="dir"),
                EnvVar(MB_VAR, "prefix cache: host memory for cached state in MiB (default 1024; LRU eviction).",
                       field="capacity_mb", kind=int),
                EnvVar(BLOCK_VAR, "prefix cache: snapshot every this many tokens (a multiple of every compression "
                                  "ratio; default the smallest such multiple >= 128).", field="block_tokens", kind=int),
            ),
            conflicts=("dspark", "swa_replay"),
            description="prefix cache: reuse window rings, compressed entries and indexer keys of cached prefixes",
        )

    @hookimpl
    def deepinfer_engine_start(self, engine: EngineContext) -> None:
        from .store import PrefixStore

        layout = engine.cache.layout
        block_tokens = self.config.block_tokens or default_block_tokens(layout)
        identity_hex = self._identity(engine, layout, block_tokens) if self.config.dir else None
        self.store = PrefixStore(layout, block_tokens, int(self.config.capacity_mb * (1 << 20)),
                                 seed=bytes.fromhex(identity_hex) if identity_hex else b"")
        if self.config.dir:
            from .persist import DiskStore

            self.disk = DiskStore(self.config.dir, identity_hex)
            loaded = self.disk.load(self.store)
            logger.info("prefix cache: %d blocks loaded from %s", loaded, self.config.dir)
        engine.cache.attach_prefix_cache(self.store)

    @hookimpl
    def deepinfer_engine_shutdown(self, engine: EngineContext) -> None:
        if self.disk is not None and self.store is not None:
            self.disk.save(self.store)

    def _identity(self, engine: EngineContext, layout: CacheLayout, block_tokens: int) -> str:
        from deepinfer import __version__
        from deepinfer.models.resolve import resolve_model

        from .persist import FORMAT, identity, layout_signature, model_fingerprint

        if engine.config is None:
            raise ValueError(f"feature '{NAME}': persistence ({DIR_VAR}) needs an engine built from an EngineConfig "
                             f"(LLM or deepinfer serve), to know which model the cache belongs to")
        path = resolve_model(engine.config.model).path
        return identity({"format": FORMAT, "engine": __version__, "backend": engine.accelerator.capabilities().name,
                         "model": model_fingerprint(path), "model_options": engine.config.model_options,
                         "dtype": engine.config.dtype, "layout": layout_signature(layout),
                         "block_tokens": block_tokens})


plugin = PrefixCachePlugin  # the entry point: the class, instantiated by each engine with its config

__all__ = ["BLOCK_VAR", "DIR_VAR", "ENV_VAR", "MB_VAR", "NAME", "PrefixCacheConfig", "PrefixCachePlugin",
           "default_block_tokens", "plugin"]
