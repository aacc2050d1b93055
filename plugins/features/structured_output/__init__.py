"""Structured outputs: constrain generation to a regex, a JSON schema or an EBNF grammar (xgrammar).

A request opts in with `SamplingParams(so_args={"schema_type": "regex"|"json"|"ebnf", "schema": ...})`.
The feature is on by default on back ends that implement `apply_token_bitmask`; it costs nothing
until the first constrained request (xgrammar and the grammar vocabulary are loaded lazily).
Configure it under `[features.structured_output]` (see `config.py`); docs/structured_outputs.md.

This module stays import-light: the entry point imports it to read the FeatureSpec.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from deepinfer.features import FeatureSpec
from deepinfer.hookspecs import EngineContext, hookimpl

from .config import StructuredOutputConfig

if TYPE_CHECKING:
    from .processor import StructuredOutputProcessor
    from .vocabulary import Vocabulary

NAME = "structured_output"


def _engine_vocabulary(engine: EngineContext, config: StructuredOutputConfig) -> Callable[[], Vocabulary]:
    """A zero-argument factory of the engine's `Vocabulary` (called at the first constrained request)."""
    def build():
        from .vocabulary import vocabulary_from_tokenizer

        return vocabulary_from_tokenizer(engine.tokenizer, engine.vocab_size, config.block_control_tokens,
                                         stop_token_ids=engine.eos_token_ids)
    return build


class StructuredOutputPlugin:
    """The feature plugin (entry point `deepinfer.features:structured_output`): one instance per
    engine that enables structured outputs, holding that engine's processor."""

    def __init__(self, config: StructuredOutputConfig) -> None:
        self.config = config
        self.processor: StructuredOutputProcessor | None = None

    @staticmethod
    @hookimpl
    def deepinfer_feature_spec() -> FeatureSpec:
        return FeatureSpec(
            name=NAME,
            config_model=StructuredOutputConfig,
            hooks=("deepinfer_feature_spec", "deepinfer_logits_processor", "deepinfer_engine_shutdown"),
            required_capabilities=("token_bitmask",),
            enabled_by_default=True,
            description="regex / JSON-schema / EBNF constrained decoding with xgrammar token bitmasks",
        )

    @hookimpl
    def deepinfer_logits_processor(self, engine: EngineContext) -> StructuredOutputProcessor:
        from .processor import StructuredOutputProcessor

        self.processor = StructuredOutputProcessor(_engine_vocabulary(engine, self.config), self.config)
        return self.processor

    @hookimpl
    def deepinfer_engine_shutdown(self) -> None:
        if self.processor is not None:
            self.processor.shutdown()
            self.processor = None


plugin = StructuredOutputPlugin  # the entry point: the class, instantiated by each engine with its config

__all__ = ["NAME", "StructuredOutputConfig", "StructuredOutputPlugin", "plugin"]
