"""DSpark speculative decoding: draft with a small model, verify every draft of every request in one
target forward, keep the longest accepted prefix plus one target token (docs/speculative_decoding.md).

Enable it with a `[features.dspark]` table (`LLM(features={"dspark": {...}})`) or the environment
variables its FeatureSpec declares: DEEPINFER_USE_NEXTN_DECODE=<k> (maximum drafts per step; 0
disables speculation) and DEEPINFER_ENABLE_MTP_VARLEN=1 (confidence-scheduled variable-length
verification). The drafter is the checkpoint's own: V4's MTP block (`mtp.0.*`, one token per pass)
or V4.1's DSpark head (`mtp.0-2`, a block of up to 5 per pass with Markov and confidence heads);
`drafter = "self"` is a test mode in which the target drafts for itself. Greedy outputs are identical to decoding without
speculation; sampled outputs keep their distribution (speculative rejection sampling).

This module stays import-light: the entry point imports it to read the FeatureSpec.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from deepinfer.envs import EnvVar
from deepinfer.features import FeatureSpec
from deepinfer.hookspecs import EngineContext, hookimpl

from .config import DSparkConfig

if TYPE_CHECKING:
    from .speculator import Speculator
    from .verify_scheduler import VerifyCostModel

NAME = "dspark"
logger = logging.getLogger("deepinfer.dspark")


def _profile_engine_forward(engine: EngineContext, config: DSparkConfig) -> VerifyCostModel:
    """The verify-cost table of this engine's model on this back end, timed with the runner's own
    batches: B sequences, each verifying q - 1 drafts after a context of `profile_context_len`."""
    from .verify_scheduler import profile_verify_cost

    k = config.num_draft_tokens
    context = max(0, min(config.profile_context_len, engine.max_model_len - k - 2))
    token = 100 % engine.vocab_size
    max_batch = min(engine.max_num_seqs, engine.cache.num_free_slots)

    def run(batch_size: int, query_len: int) -> None:
        engine.runner.dummy_run(engine.cache, batch_size, query_len, context, token)

    return profile_verify_cost(run, max_batch, k + 1, engine.max_num_batched_tokens)


class DSparkPlugin:
    """The feature plugin (entry point `deepinfer.features:dspark`): one instance per engine that
    enables speculative decoding; it contributes the engine's `Speculation` (drafter and policy)."""

    def __init__(self, config: DSparkConfig) -> None:
        self.config = config

    @staticmethod
    @hookimpl
    def deepinfer_feature_spec() -> FeatureSpec:
        return FeatureSpec(
            name=NAME,
            config_model=DSparkConfig,
            hooks=("deepinfer_feature_spec", "deepinfer_draft_proposer"),
            env_vars=(
                EnvVar("DEEPINFER_USE_NEXTN_DECODE",
                       "Maximum speculative draft length (default 5); 0 disables speculation.",
                       field="num_draft_tokens", kind=int),
                EnvVar("DEEPINFER_ENABLE_MTP_VARLEN",
                       "1: confidence-scheduled variable-length verification (turns speculation on); 0: "
                       "fixed-length verification when speculation is on (it does not turn it on).",
                       field="variable_length", kind=bool, enables_feature="when_true"),
            ),
            required_capabilities=("rejection_sampling",),
            slots=("draft_proposer",),
            description="speculative decoding: MTP drafts, one ragged verify forward, exact-match / rejection "
                        "acceptance, optional confidence-scheduled variable-length verification",
        )

    @hookimpl
    def deepinfer_draft_proposer(self, engine: EngineContext) -> Speculator:
        from .mtp_drafter import MtpDrafter
        from .self_drafter import SelfDrafter
        from .speculator import Speculator
        from .verify_scheduler import format_cost_table

        config = self.config
        have = engine.cache.layout.max_rollback
        if have < config.max_rollback:
            raise ValueError(f"the dspark feature needs cache rings that can roll back {config.max_rollback} positions "
                             f"(num_draft_tokens + 1), but the engine's cache layout was built with max_rollback="
                             f"{have}; build the layout with model.cache_layout({config.max_rollback}) (the engine "
                             f"builder does this from the feature config)")
        if config.drafter == "self":
            drafter = SelfDrafter(engine.model, engine.accelerator, num_draft_tokens=config.num_draft_tokens,
                                  max_num_seqs=engine.max_num_seqs, max_model_len=engine.max_model_len,
                                  block_size=engine.cache.block_size, error_rate=config.self_draft_error_rate,
                                  shared_generator=engine.generator)
        elif getattr(engine.model, "dspark", None) is not None:  # DeepSeek-V4.1 with its DSpark head
            from .dspark_drafter import DSparkDrafter

            drafter = DSparkDrafter(engine.model, engine.accelerator, config.num_draft_tokens,
                                    config.confidence_input, engine.generator)
        else:
            drafter = MtpDrafter(engine.model, engine.accelerator, engine.generator)
        cost = None
        if config.variable_length:
            cost = _profile_engine_forward(engine, config)
            logger.info("dspark verify-cost table (%s): %s", engine.accelerator.capabilities().name,
                        format_cost_table(cost))
        return Speculator(drafter, config, cost_model=cost)


plugin = DSparkPlugin  # the entry point: the class, instantiated by each engine with its DSparkConfig

__all__ = ["NAME", "DSparkConfig", "DSparkPlugin", "plugin"]
