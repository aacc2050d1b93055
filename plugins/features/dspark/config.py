"""Settings of the DSpark speculative-decoding feature: the `[features.dspark]` table.

Two environment variables map onto fields (declared on the FeatureSpec, in `__init__.py`):
DEEPINFER_USE_NEXTN_DECODE -> `num_draft_tokens`, DEEPINFER_ENABLE_MTP_VARLEN -> `variable_length`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: More drafts than this cost more to verify than they can return (per-position acceptance of
#: published real drafters is below 10% by position 7).
MAX_DRAFT_TOKENS = 16


class DSparkConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_draft_tokens: int = Field(
        5, ge=0, le=MAX_DRAFT_TOKENS,
        description="maximum draft tokens per request per step (DEEPINFER_USE_NEXTN_DECODE); 0 disables speculation")
    variable_length: bool = Field(
        False, description="confidence-scheduled verification (DEEPINFER_ENABLE_MTP_VARLEN): per step, verify per "
                           "request only the drafts whose expected gain pays for their verify cost")
    drafter: Literal["mtp", "self"] = Field(
        "mtp", description="'mtp': the checkpoint's own drafter drafts (DeepSeek-V4: the MTP block mtp.0.*; "
                           "DeepSeek-V4.1: the DSpark head mtp.0-2); 'self': test mode, the target model drafts for "
                           "itself (100% greedy acceptance, about (1 + num_draft_tokens) times the cost)")
    confidence_input: Literal["normed", "residual"] = Field(
        "normed", description="DeepSeek-V4.1 DSpark: what the confidence head reads with the Markov embedding: the "
                              "final norm's output ('normed', as NVIDIA NeMo AutoModel trains it) or the residual "
                              "before it ('residual', as DeepSeek's released reference reads it)")
    self_draft_error_rate: float = Field(
        0.0, ge=0.0, le=1.0,
        description="test mode, with drafter='self': replace this share of the drafted tokens by a wrong token "
                    "(chosen deterministically), to exercise partial acceptance and rollback")
    profile_context_len: int = Field(
        128, ge=0, description="context length of the synthetic batches timed at start-up for the verify-cost "
                               "table (variable_length only)")

    @property
    def enabled(self) -> bool:
        """The feature set drops a feature whose config says it is off (num_draft_tokens = 0)."""
        return self.num_draft_tokens > 0

    @property
    def max_rollback(self) -> int:
        """Positions the engine must be able to drop exactly after writing them: every draft of a
        step may be rejected, and the drafter writes one position past its last draft."""
        return self.num_draft_tokens + 1
