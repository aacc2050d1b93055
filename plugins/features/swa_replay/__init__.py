"""SWA bounded replay: decoder-side bounded replay of DeepSeek-V4.1 prefill (docs/swa_replay.md).

Enable it with DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact (DEEPINFER_YOCO_PREFILL_KEEP_TOKENS,
default 140, sets how many prompt rows the decoder runs) or a `[features.swa_replay]` table.
The row dropping itself is a property of how the V4.1 model runs prefill and lives in the core
(`deepinfer.models.deepseek_v41.replay`); this plugin validates the setting against the model and
the engine and switches the model into it when the engine starts (`model.set_bounded_replay`).

Refused at start-up, with the fix: a model without an encoder/decoder split (DeepSeek-V4, any
model without `set_bounded_replay`) and a keep_tokens below sliding_window + 2 x the speculative
verify width (`cache.layout.max_rollback`, which is 1 + drafts when speculative decoding is on).

This module stays import-light: the entry point imports it to read the FeatureSpec.
"""
from __future__ import annotations

from deepinfer.envs import EnvVar
from deepinfer.features import FeatureSpec
from deepinfer.hookspecs import EngineContext, hookimpl

from .config import SwaReplayConfig

NAME = "swa_replay"
MODE_VAR = "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"
KEEP_VAR = "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"


class SwaReplayPlugin:
    """The feature plugin (entry point `deepinfer.features:swa_replay`): one instance per engine that
    enables it; it puts that engine's V4.1 model into bounded-replay prefill."""

    def __init__(self, config: SwaReplayConfig) -> None:
        self.config = config

    @staticmethod
    @hookimpl
    def deepinfer_feature_spec() -> FeatureSpec:
        return FeatureSpec(
            name=NAME,
            config_model=SwaReplayConfig,
            hooks=("deepinfer_feature_spec", "deepinfer_engine_start"),
            env_vars=(
                EnvVar(MODE_VAR, "compact: DeepSeek-V4.1 prefill runs the decoder layers only on the last "
                                 f"{KEEP_VAR} prompt rows (approximate, SWA bounded replay); off: exact prefill.",
                       field="mode"),
                EnvVar(KEEP_VAR, "prompt rows per request the V4.1 decoder runs under bounded replay (default 140; "
                                 "at least sliding_window + 2 x the speculative verify width).",
                       field="keep_tokens", kind=int),
            ),
            description="SWA bounded replay: V4.1 decoder layers prefill only the last keep_tokens prompt rows",
        )

    @hookimpl
    def deepinfer_engine_start(self, engine: EngineContext) -> None:
        from deepinfer.models.deepseek_v41.replay import minimum_keep_tokens

        model = engine.model
        if not callable(getattr(model, "set_bounded_replay", None)):
            raise ValueError(f"feature '{NAME}': SWA bounded replay needs a DeepSeek-V4.1 model (an encoder/decoder "
                             f"split); {type(model).__name__} has none. Set {MODE_VAR}=off (or unset it) for this "
                             f"model")
        rollback = engine.cache.layout.max_rollback
        minimum = minimum_keep_tokens(model.config, rollback)
        keep = self.config.keep_tokens
        if keep < minimum:
            spec = f" + 2 x verify width {rollback}" if rollback else " (no speculative decoding)"
            raise ValueError(f"feature '{NAME}': {KEEP_VAR}={keep} is below the minimum {minimum} (sliding_window "
                             f"{model.config.sliding_window}{spec}); set {KEEP_VAR}={minimum} or more")
        model.set_bounded_replay(keep)


plugin = SwaReplayPlugin  # the entry point: the class, instantiated by each engine with its config

__all__ = ["KEEP_VAR", "MODE_VAR", "NAME", "SwaReplayConfig", "SwaReplayPlugin", "plugin"]
