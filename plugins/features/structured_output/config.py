"""Settings of the structured-output feature: the `[features.structured_output]` table."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StructuredOutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="false turns the feature off (requests with so_args are then refused)")
    strict_json: bool = Field(
        True, description="JSON schemas: objects and arrays admit no properties/items the schema does not "
                          "declare (xgrammar strict_mode), and strings never contain raw control characters")
    any_whitespace: bool = Field(
        False, description="JSON schemas: let the model choose the whitespace between tokens; false fixes "
                           "it to ', ' and ': ' (no whitespace loops)")
    max_whitespace: int | None = Field(
        None, ge=1, description="with any_whitespace: the most whitespace characters in a row")
    compile_workers: int = Field(1, ge=1, description="threads compiling grammars off the engine thread")
    compiler_threads: int = Field(2, ge=1, description="threads xgrammar uses inside one compilation")
    cache_size: int = Field(256, ge=0, description="compiled grammars kept (least recently used dropped); 0 = none")
    block_control_tokens: bool = Field(
        True, description="never let a constraint emit an added (control or special) token other than EOS")
