"""Structured outputs: constrain generation to a regex, a JSON schema or an EBNF grammar (xgrammar).

A request opts in with `SamplingParams(so_args={"schema_type": "regex"|"json"|"ebnf", "schema": ...})`.
The feature is on by default on back ends that implement `apply_token_bitmask`; it costs nothing
until the first constrained request (xgrammar and the grammar vocabulary are loaded lazily).
Configure it under `[features.structured_output]` (see `config.py`); docs/structured_outputs.md.

This module stays import-light: the entry point imports it to read the FeatureSpec.
"""
from __future__ import annotations

from typing import Any

from deepinfer.features import FeatureSpec
from deepinfer.hookspecs import hookimpl

from .config import StructuredOutputConfig

NAME = "structured_output"


def _engine_vocabulary(engine: Any, config: StructuredOutputConfig):
    """A zero-argument factory of the engine's `Vocabulary` (called at the first constrained request)."""
    def build():
        from .vocabulary import vocabulary_from_tokenizer

        return vocabulary_from_tokenizer(engine.tokenizer, engine.vocab_size, config.block_control_tokens,
                                         stop_token_ids=getattr(engine, "eos_token_ids", None))
    return build


class StructuredOutputPlugin:
    """The pluggy plugin object registered under the entry point `deepinfer.features:structured_output`."""

    def __init__(self) -> None:
        self._processors: dict[int, Any] = {}  # id(engine) -> its processor, for shutdown

    @hookimpl
    def deepinfer_feature_spec(self) -> FeatureSpec:
        return FeatureSpec(
            name=NAME,
            config_model=StructuredOutputConfig,
            hooks=("deepinfer_feature_spec", "deepinfer_logits_processor", "deepinfer_engine_shutdown"),
            required_capabilities=("token_bitmask",),
            enabled_by_default=True,
            description="regex / JSON-schema / EBNF constrained decoding with xgrammar token bitmasks",
        )

    @hookimpl
    def deepinfer_logits_processor(self, engine: Any, feature_config: StructuredOutputConfig):
        from .processor import StructuredOutputProcessor

        config = feature_config or StructuredOutputConfig()
        processor = StructuredOutputProcessor(_engine_vocabulary(engine, config), config)
        self._processors[id(engine)] = processor
        return processor

    @hookimpl
    def deepinfer_engine_shutdown(self, engine: Any) -> None:
        processor = self._processors.pop(id(engine), None)
        if processor is not None:
            processor.shutdown()


plugin = StructuredOutputPlugin()

__all__ = ["NAME", "StructuredOutputConfig", "StructuredOutputPlugin", "plugin"]
