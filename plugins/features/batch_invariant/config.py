"""Settings of the batch-invariant feature: the `[features.batch_invariant]` table.

DEEPINFER_BATCH_INVARIANT (declared on the FeatureSpec, in `__init__.py`) sets `enabled`; setting it
(to 1 or 0) or writing the table turns the feature's check on, and `enabled = false` leaves it off.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class BatchInvariantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        True, description="run every kernel in the back end's batch-invariant mode (DEEPINFER_BATCH_INVARIANT): a "
                          "request's logits, and so its greedy or seq_seed-sampled tokens, are the same bits alone "
                          "or in any batch; false leaves the feature off")
