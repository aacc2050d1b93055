"""Pydantic models of what crosses the server's boundary: its settings, the `/v1/completions`
request and response, the Chat Completions fields the server reads itself, and the OpenAI-style
error body.

Request models are strict: a JSON value of the wrong type is refused, never converted (`true` is
not the token id 1, `"yes"` is not `stream: true`). Chat Completions requests are otherwise not
modelled here: deepseek-recipe parses and validates them (`chat_format.py`), so the accepted fields
are exactly the ones it renders into the prompt.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

#: The request-body extension that asks for a regex or EBNF constraint (vLLM's spelling):
#: `{"structured_outputs": {"regex": "..."}}` or `{"structured_outputs": {"grammar": "..."}}`.
STRUCTURED_OUTPUTS_FIELD = "structured_outputs"


class ServerSettings(BaseModel):
    """`deepinfer serve` settings (each is a command-line flag; see docs/server.md)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    #: when set, every route but /health needs `Authorization: Bearer <api_key>`
    api_key: str | None = None
    served_model_name: str | None = None  # None: the checkpoint folder's name
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_prompt_tokens: int | None = Field(None, ge=1)  # None: the engine's max_model_len
    #: requests accepted and not finished (waiting + running); more get HTTP 429
    max_pending: int = Field(256, ge=1)
    request_timeout_s: float = Field(600.0, gt=0)
    #: a request body must arrive within this many seconds (a slow or short body gets 408)
    body_timeout_s: float = Field(30.0, gt=0)
    #: on shutdown (SIGTERM, Ctrl-C) requests still running get this many seconds before they are aborted
    shutdown_timeout_s: float = Field(5.0, ge=0)
    #: whether a chat request that does not say (`"thinking": {...}`) runs in thinking mode
    default_thinking: bool = True

    @model_validator(mode="after")
    def _key_not_blank(self) -> ServerSettings:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; give a non-empty key or leave it unset")
        return self


#: the seeds both routes accept (deepseek-recipe's chat range; 64-bit signed, non-negative)
SEED_LIMIT = 2**63


class StructuredOutputs(BaseModel):
    """The `structured_outputs` extension: exactly one of `regex` and `grammar` (EBNF)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    regex: str | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        if (self.regex is None) == (self.grammar is None):
            raise ValueError("structured_outputs takes exactly one of 'regex' and 'grammar' (EBNF)")
        return self

    def so_args(self) -> dict[str, str]:
        if self.regex is not None:
            return {"schema_type": "regex", "schema": self.regex}
        return {"schema_type": "ebnf", "schema": self.grammar}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class CompletionRequest(BaseModel):
    """`POST /v1/completions`: a raw prompt (text, tokenised with BOS, or token ids), no chat format."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stream: bool = False
    stream_options: StreamOptions | None = None
    structured_outputs: StructuredOutputs | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported; send one request per choice")
        return n


class ChatFields(BaseModel):
    """The fields of a Chat Completions body that the server reads itself, checked strictly before
    the whole body goes to deepseek-recipe (which validates the rest, and renders the prompt)."""

    model_config = ConfigDict(extra="allow", strict=True)

    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    parallel_tool_calls: bool | None = None
    structured_outputs: StructuredOutputs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deepinfer"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object; clients (the `openai` package) read `error.message`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code or kind}}


def validation_message(e: ValidationError, what: str = "invalid request") -> str:
    """pydantic's errors as one line: `what: field: problem; ...`."""
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return f"{what}: " + "; ".join(parts)
