"""What the dspark feature contributes to the core's `draft_proposer` slot: a `Speculation`.

The core (`deepinfer.engine.speculative`) verifies the drafts, accepts, rolls back and keeps the
statistics; the feature supplies the drafter (the V4 MTP block, or the self-drafting test mode)
and, with `variable_length`, the verification policy (`verify_scheduler.VariableLengthPolicy`).
"""
from __future__ import annotations

from deepinfer.engine.speculative import Drafter, Speculation

from .config import DSparkConfig
from .verify_scheduler import VariableLengthPolicy, VerifyCostModel


class Speculator(Speculation):
    """The dspark `Speculation`: `drafter`, `num_draft_tokens` from the config, and the
    variable-length policy when `config.variable_length` (which needs the profiled `cost_model`)."""

    def __init__(self, drafter: Drafter, config: DSparkConfig, cost_model: VerifyCostModel | None = None):
        if config.variable_length and cost_model is None:
            raise ValueError("variable-length verification needs a verify-cost table")
        policy = VariableLengthPolicy(cost_model, config.num_draft_tokens) if config.variable_length else None
        super().__init__(drafter=drafter, num_draft_tokens=config.num_draft_tokens, policy=policy)
