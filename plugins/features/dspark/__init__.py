"""DSpark speculative decoding: draft with a small model, verify every draft of every request in one
target forward, keep the longest accepted prefix plus one target token (docs/speculative_decoding.md).

Enable it with a `[features.dspark]` table (`LLM(features={"dspark": {...}})`) or the environment:
DEEPINFER_USE_NEXTN_DECODE=<k> (maximum drafts per step; 0 disables speculation) and
DEEPINFER_ENABLE_MTP_VARLEN=1 (confidence-scheduled variable-length verification). The drafter is
the checkpoint's MTP block (`mtp.0.*`, V4); `drafter = "self"` is a test mode in which the target
drafts for itself. Greedy outputs are identical to decoding without speculation; sampled outputs
keep their distribution (speculative rejection sampling).

This module stays import-light: the entry point imports it to read the FeatureSpec.
"""
from __future__ import annotations

import logging
from typing import Any

from deepinfer.features import FeatureSpec
from deepinfer.hookspecs import hookimpl

from .config import DSparkConfig

NAME = "dspark"
logger = logging.getLogger("deepinfer.dspark")


def _profile_engine_forward(engine: Any, config: DSparkConfig):
    """The verify-cost table of this engine's model on this back end, timed with the runner's own
    batches: B sequences, each verifying q - 1 drafts after a context of `profile_context_len`."""
    from deepinfer.engine.request import Request
    from deepinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
    from deepinfer.sampling_params import SamplingParams

    from .verify_scheduler import profile_verify_cost

    k = config.num_draft_tokens
    context = max(0, min(config.profile_context_len, engine.max_model_len - k - 2))
    token = 100 % engine.vocab_size
    max_batch = min(engine.scheduler.max_num_seqs, engine.cache.num_free_slots)

    def run(batch_size: int, query_len: int) -> None:
        requests = [Request(request_id=f"dspark-profile-{i}", prompt=None,
                            prompt_token_ids=[token] * (context + 1), params=SamplingParams(max_tokens=1),
                            arrival_index=-1) for i in range(batch_size)]
        try:
            for r in requests:
                if not engine.cache.allocate(r, context + query_len):
                    raise RuntimeError("the cache pool is too small to time this batch")
            scheduled = [ScheduledRequest(request=r, context_len=context, token_ids=[token], num_placeholders=0,
                                          sample=True, output_index=0, draft_token_ids=[token] * (query_len - 1))
                         for r in requests]
            step = engine.runner.prepare(SchedulerOutput(step_id=0, scheduled=scheduled), None)
            engine.model.forward(step.batch)
            engine.accelerator.synchronize()
        finally:
            for r in requests:
                engine.cache.free(r)

    return profile_verify_cost(run, max_batch, k + 1, engine.scheduler.max_num_batched_tokens)


class DSparkPlugin:
    """The pluggy plugin object registered under the entry point `deepinfer.features:dspark`."""

    def __init__(self) -> None:
        self._speculators: dict[int, Any] = {}  # id(engine) -> its Speculator

    @hookimpl
    def deepinfer_feature_spec(self) -> FeatureSpec:
        return FeatureSpec(
            name=NAME,
            config_model=DSparkConfig,
            hooks=("deepinfer_feature_spec", "deepinfer_draft_proposer", "deepinfer_request_finished",
                   "deepinfer_engine_shutdown"),
            required_capabilities=("rejection_sampling",),
            slots=("draft_proposer",),
            description="speculative decoding: MTP drafts, one ragged verify forward, exact-match / rejection "
                        "acceptance, optional confidence-scheduled variable-length verification",
        )

    @hookimpl
    def deepinfer_draft_proposer(self, engine: Any, feature_config: DSparkConfig):
        from .mtp_drafter import MtpDrafter
        from .self_drafter import SelfDrafter
        from .speculator import Speculator
        from .verify_scheduler import format_cost_table

        config = feature_config or DSparkConfig()
        have = engine.cache.layout.max_rollback
        if have < config.max_rollback:
            raise ValueError(f"the dspark feature needs cache rings that can roll back {config.max_rollback} positions "
                             f"(num_draft_tokens + 1), but the engine's cache layout was built with max_rollback="
                             f"{have}; build the layout with model.cache_layout({config.max_rollback}) (the engine "
                             f"builder does this from the feature config)")
        generator = engine.sampler.generator
        if config.drafter == "self":
            drafter = SelfDrafter(engine.model, engine.accelerator, num_draft_tokens=config.num_draft_tokens,
                                  max_num_seqs=engine.scheduler.max_num_seqs, max_model_len=engine.max_model_len,
                                  block_size=engine.cache.block_size, error_rate=config.self_draft_error_rate,
                                  shared_generator=generator)
        else:
            drafter = MtpDrafter(engine.model, engine.accelerator, generator)
        cost = None
        if config.variable_length:
            cost = _profile_engine_forward(engine, config)
            logger.info("dspark verify-cost table (%s): %s", engine.accelerator.capabilities().name,
                        format_cost_table(cost))
        speculator = Speculator(drafter, config, engine.accelerator, engine.max_model_len, cost)
        self._speculators[id(engine)] = speculator
        return speculator

    @hookimpl
    def deepinfer_request_finished(self, request: Any) -> None:
        for speculator in self._speculators.values():
            speculator.forget(request.request_id)

    @hookimpl
    def deepinfer_engine_shutdown(self, engine: Any) -> None:
        self._speculators.pop(id(engine), None)


plugin = DSparkPlugin()

__all__ = ["NAME", "DSparkConfig", "DSparkPlugin", "plugin"]
