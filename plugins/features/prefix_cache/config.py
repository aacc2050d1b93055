"""Settings of the prefix cache: the `[features.prefix_cache]` table.

Environment variables (declared on the FeatureSpec, in `__init__.py`): DEEPINFER_PREFIX_CACHE ->
`enabled`, DEEPINFER_PREFIX_CACHE_DIR -> `dir`, DEEPINFER_PREFIX_CACHE_MB -> `capacity_mb`,
DEEPINFER_PREFIX_CACHE_BLOCK_TOKENS -> `block_tokens`. Setting any of them (or writing the table)
enables the feature; `enabled = false` leaves it off.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_CAPACITY_MB = 1024.0
#: the default block is the smallest multiple of every compression ratio that is at least this long
DEFAULT_MIN_BLOCK_TOKENS = 128


class PrefixCacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="reuse the model state of cached prompt prefixes "
                                            "(DEEPINFER_PREFIX_CACHE); false leaves the feature off")
    block_tokens: int | None = Field(
        None, ge=1, description="snapshots sit at multiples of this many tokens (DEEPINFER_PREFIX_CACHE_BLOCK_TOKENS); "
                                "must be a multiple of every compression ratio of the model. None: the smallest "
                                f"such multiple of at least {DEFAULT_MIN_BLOCK_TOKENS} tokens")
    capacity_mb: float = Field(
        DEFAULT_CAPACITY_MB, gt=0, description="host memory for cached state, in MiB (DEEPINFER_PREFIX_CACHE_MB); the "
                                               "least recently used blocks are evicted beyond it")
    dir: str | None = Field(
        None, description="persist the cache in this directory (DEEPINFER_PREFIX_CACHE_DIR): loaded at engine start, "
                          "written at shutdown; a private store (created 0700, refused unless it is yours and "
                          "writable by nobody else; files 0600); files are checksummed and versioned by model, "
                          "engine and layout, and a file that is corrupt, mismatched or does not fit the cache "
                          "layout is skipped with a warning")
