"""Settings of the SWA bounded-replay feature: the `[features.swa_replay]` table.

Two environment variables map onto fields (declared on the FeatureSpec, in `__init__.py`):
DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE -> `mode`, DEEPINFER_YOCO_PREFILL_KEEP_TOKENS -> `keep_tokens`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_KEEP_TOKENS = 140  # one 128-token window + 2 x a DSpark verify width of 6 (1 anchor + 5 drafts)


class SwaReplayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["compact", "off"] = Field(
        "compact", description="prefill truncation (DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE): 'compact' runs the V4.1 "
                               "decoder layers only on the last keep_tokens prompt rows of each request, gathered "
                               "into a dense sub-batch; 'off' is exact prefill (the feature stays off)")
    keep_tokens: int = Field(
        DEFAULT_KEEP_TOKENS, ge=1,
        description="prompt rows per request the decoder runs under 'compact' (DEEPINFER_YOCO_PREFILL_KEEP_TOKENS); at "
                    "least sliding_window + 2 x the speculative verify width, checked at engine start")

    @property
    def enabled(self) -> bool:
        """The feature set drops a feature whose config says it is off (mode 'off': exact prefill)."""
        return self.mode != "off"
