"""Batch-invariant inference: a request's results do not depend on what it is batched with.

Enable it with DEEPINFER_BATCH_INVARIANT=1 or a `[features.batch_invariant]` table. The feature
needs a back end that declares `Capabilities.batch_invariant` (the cpu back end does, with its C
kernels) and switches it into its batch-invariant mode (`Accelerator.set_batch_invariant(True)`)
when the engine starts, before the first forward: every reduction (products, attention, MoE
combine, norms, softmaxes) then has an order fixed by the row's own inputs, so a request's logits
are the same bits alone, in any batch, in any prefill chunk, and after a preemption. With a
per-request `seq_seed` the sampled tokens are then identical too. docs/batch_invariance.md has the
guarantee, its limits and its cost.

Speculative decoding: with fixed-length verification every guarantee holds. With
confidence-scheduled verification (DEEPINFER_ENABLE_MTP_VARLEN=1, the seeds' NVIDIA setting) the
number of drafts each request verifies depends on the batch; the forward stays invariant, so greedy
tokens and their log-probabilities still do not depend on the batch, but seq_seed-sampled tokens
may (rejection sampling draws differently for a different number of drafts).

This module stays import-light: the entry point imports it to read the FeatureSpec.
"""
from __future__ import annotations

from deepinfer.envs import EnvVar
from deepinfer.features import FeatureSpec
from deepinfer.hookspecs import EngineContext, hookimpl

from .config import BatchInvariantConfig

NAME = "batch_invariant"
ENV_VAR = "DEEPINFER_BATCH_INVARIANT"


class BatchInvariantPlugin:
    """The feature plugin (entry point `deepinfer.features:batch_invariant`): one instance per engine
    that enables it; it switches that engine's back end into batch-invariant mode."""

    def __init__(self, config: BatchInvariantConfig) -> None:
        self.config = config

    @staticmethod
    @hookimpl
    def deepinfer_feature_spec() -> FeatureSpec:
        return FeatureSpec(
            name=NAME,
            config_model=BatchInvariantConfig,
            hooks=("deepinfer_feature_spec", "deepinfer_engine_start"),
            env_vars=(EnvVar(ENV_VAR, "1: batch-invariant kernels (a request's logits and seq_seed-sampled tokens "
                                      "do not depend on its batch); 0: off.", field="enabled", kind=bool),),
            required_capabilities=("batch_invariant",),
            description="batch-invariant kernels: results independent of batching, chunking and preemption",
        )

    @hookimpl
    def deepinfer_engine_start(self, engine: EngineContext) -> None:
        engine.accelerator.set_batch_invariant(True)


plugin = BatchInvariantPlugin  # the entry point: the class, instantiated by each engine with its config

__all__ = ["ENV_VAR", "NAME", "BatchInvariantConfig", "BatchInvariantPlugin", "plugin"]
