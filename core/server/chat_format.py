"""The deepseek-recipe adapter: Chat Completions requests in, prompt token ids and sampling settings
out; generated token ids in, Chat Completions chunks (text, reasoning, parsed tool calls) out.

Everything about DeepSeek's chat format comes from two libraries and nothing is written here by
hand: deepseek-recipe renders the request into the V4 or V4.1 prompt (`DeepseekV4Encoding` /
`DeepseekV41Encoding`), resolves the sampling values, and parses the output stream; xgrammar's
built-in DeepSeek structural tags (`deepseek_v4`, `deepseek_v4_1`) turn the output constraint the
recipe reports (JSON schema, regex, tool calls) into a grammar, handed to the structured-output
feature as EBNF (`so_args`).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from deepinfer.sampling_params import SamplingParams
from deepinfer.server.protocol import STRUCTURED_OUTPUTS_FIELD, ChatFields, validation_message

# config.json model_type -> (recipe ModelVersion, recipe encoding class, xgrammar structural-tag key)
FAMILIES: dict[str, tuple[str, str, str]] = {
    "deepseek_v4": ("DeepseekV4Pro", "DeepseekV4Encoding", "deepseek_v4"),
    "deepseek_v41": ("DeepseekV41Flash", "DeepseekV41Encoding", "deepseek_v4_1"),
}

#: the longest run of whitespace a tool-call grammar allows between its markers
MAX_WHITESPACE = 2


class RequestError(Exception):
    """A request the server refuses: HTTP `status` and the message for the client."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def import_recipe():
    """deepseek_recipe, or a start-up error that says how to install it."""
    try:
        import deepseek_recipe
    except ImportError as e:
        raise RuntimeError(
            "deepinfer serve renders and parses DeepSeek chat messages with the package 'deepseek-recipe', "
            f"which cannot be imported ({e}); install it with `pip install 'deepinfer[serve]'` "
            "(or `pip install deepseek-recipe`)") from None
    return deepseek_recipe


def tokenizer_file(tokenizer: Any) -> str | None:
    """The tokenizer.json behind an engine's tokenizer, None when the engine has no text tokenizer."""
    return getattr(tokenizer, "source", None) if getattr(tokenizer, "has_text", False) else None


@dataclass
class PreparedChat:
    """One chat request made ready for the engine."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    conversation_request: Any  # the recipe's ConversationRequest (parsing options, chunk generator)


class ChatFormat:
    """Chat rendering and parsing for one served model.

    `unavailable` is None when chat works, else the reason (the model family has no DeepSeek
    encoding, the engine has no tokenizer file, or the tokenizer lacks a special token the encoding
    needs); `/v1/chat/completions` then answers 503 with it while `/v1/completions` keeps working.
    """

    def __init__(self, *, model_type: str, tokenizer_file: str | None, served_model_name: str,
                 max_model_len: int, default_thinking: bool = True):
        self.dr = import_recipe()
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.unavailable: str | None = None
        if model_type not in FAMILIES:
            self.unavailable = (f"chat needs a DeepSeek-V4 or V4.1 checkpoint; this one is {model_type!r} "
                                f"(use /v1/completions)")
            return
        version, encoding, self.tag_key = FAMILIES[model_type]
        self.version = getattr(self.dr.ModelVersion, version)
        # only the served name is accepted, so a request cannot pick the other family's encoding
        self.options = self.dr.ConversionOptions(default_thinking_mode=default_thinking) \
            .with_model_versions_by_name({served_model_name: self.version})
        if not tokenizer_file:
            self.unavailable = "chat needs the model's tokenizer.json, and this engine runs without a tokenizer"
            return
        self.tokenizer = self.dr.Tokenizer.from_file(str(tokenizer_file))
        self.encoding = getattr(self.dr, encoding)().with_tokenizer(self.tokenizer)
        try:  # a V4.1 encoding over a V4 tokenizer fails here (no <｜System｜> token), not per request
            self.encoding.encode(self.dr.Conversation([self.dr.UserMessage("hello")]))
        except RuntimeError as e:
            self.unavailable = (f"the tokenizer {tokenizer_file} cannot encode the {model_type} chat format ({e}); "
                                f"serve the checkpoint with the tokenizer of its release")

    # -- requests ---------------------------------------------------------------------------------

    def prepare(self, body: dict[str, Any]) -> PreparedChat:
        """Render, encode and map one request body; RequestError (4xx) for a bad request."""
        if self.unavailable is not None:
            raise RequestError(503, self.unavailable, "unavailable")
        try:
            fields = ChatFields.model_validate(body)
        except ValidationError as e:
            raise RequestError(400, validation_message(e)) from None
        body = dict(body)
        body.pop(STRUCTURED_OUTPUTS_FIELD, None)  # the server's extension; the recipe does not know it
        extension = fields.structured_outputs
        if extension is not None and (body.get("response_format") or body.get("tools")):
            raise RequestError(400, f"give {STRUCTURED_OUTPUTS_FIELD} or response_format / tools, not both")
        if fields.logprobs or fields.top_logprobs:
            raise RequestError(400, "logprobs are not supported by this server yet; leave logprobs unset")
        include_usage = fields.stream_options is not None and fields.stream_options.include_usage
        try:
            req = self.dr.ChatCompletionRequest(body).convert(self.options)
        except self.dr.ConversionError as e:
            raise RequestError(e.status_code if 400 <= e.status_code < 500 else 400, _recipe_message(e)) from None
        except ValueError as e:  # malformed body
            raise RequestError(400, str(e)) from None
        try:
            ids = self.encoding.encode(req.conversation)
            max_tokens = req.resolve_max_tokens(len(ids), self.max_model_len)
        except self.dr.ConversionError as e:
            raise RequestError(400, _recipe_message(e)) from None
        except RuntimeError as e:
            raise RequestError(400, f"the conversation cannot be encoded: {e}") from None
        opts = req.inference_options
        thinking = req.parsing_options.thinking_initial_stage is not None
        so_args = extension.so_args() if extension is not None else None
        if thinking and so_args is not None:  # the constraint applies after the reasoning
            so_args = self._answer_after_reasoning(so_args)
        if opts.output_constraint is not None:
            so_args = self._so_args(opts.output_constraint, thinking, req.conversation,
                                    parallel=fields.parallel_tool_calls is not False)
        stop = list(req.parsing_options.stop_sequences) or None
        try:
            params = SamplingParams(temperature=opts.temperature if opts.temperature is not None else 1.0,
                                    top_p=opts.top_p if opts.top_p is not None else 1.0, max_tokens=max_tokens,
                                    stop=stop, seq_seed=opts.seed, so_args=so_args)
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        return PreparedChat(ids, params, bool(req.stream), include_usage, req)

    def _so_args(self, constraint: Any, thinking: bool, conversation: Any, parallel: bool = True) -> dict[str, Any]:
        kind, schema = constraint.kind, constraint.schema
        if kind in ("json", "regex"):
            so = {"schema_type": kind, "schema": schema or json.dumps({"type": "object"})}
            return self._answer_after_reasoning(so) if thinking else so
        if kind not in ("tool_call", "tool_call_required"):
            raise RequestError(400, f"output constraint {kind!r} is not supported")
        from xgrammar.builtin_structural_tag import get_model_structural_tag
        from xgrammar.structural_tag import ConstStringFormat, SequenceFormat

        tools = json.loads(schema)
        choice = "auto" if kind == "tool_call" else "required"
        # whitespace runs are bounded, as the structured-output feature bounds them in JSON: a
        # model must not be able to loop on blanks between the tool-call markers
        tag = get_model_structural_tag(self.tag_key, tools=tools, tool_choice=choice,
                                       reasoning="enabled" if thinking else "disabled",
                                       max_whitespace_cnt=MAX_WHITESPACE, parallel_tool_calls=parallel)
        if kind == "tool_call_required":
            # the recipe's prompt already opened the tool-call block (its parser starts inside it):
            # the grammar's leading literal, which writes that opening, must not be generated again
            fmt = tag.format
            opening = fmt.elements[0] if isinstance(fmt, SequenceFormat) and fmt.elements else None
            prompt_text = self.encoding.render_conversation(conversation).prompt
            if not isinstance(opening, ConstStringFormat) or not prompt_text.endswith(opening.value):
                raise RuntimeError("the recipe's required-tool prompt does not end with the tool-call opening "
                                   "xgrammar's DeepSeek tag writes; the two libraries disagree")
            tag = tag.model_copy(update={"format": SequenceFormat(elements=fmt.elements[1:])})
        return _ebnf(tag)

    def _answer_after_reasoning(self, so_args: dict[str, Any]) -> dict[str, Any]:
        """In thinking mode the output is reasoning, `</think>`, then the answer: the constraint
        goes after xgrammar's DeepSeek reasoning block."""
        from xgrammar.builtin_structural_tag import get_model_structural_tag
        from xgrammar.structural_tag import GrammarFormat, JSONSchemaFormat, RegexFormat, SequenceFormat

        kind, schema = so_args["schema_type"], so_args["schema"]
        answer = (JSONSchemaFormat(json_schema=json.loads(schema) if isinstance(schema, str) else schema)
                  if kind == "json" else RegexFormat(pattern=schema) if kind == "regex"
                  else GrammarFormat(grammar=schema))
        tag = get_model_structural_tag(self.tag_key, tools=[], reasoning="enabled")
        reasoning = tag.format.elements[0]
        return _ebnf(tag.model_copy(update={"format": SequenceFormat(elements=[reasoning, answer])}))

    # -- output -----------------------------------------------------------------------------------

    def output(self, prepared: PreparedChat, request_id: str, tokenizer: Any) -> ChatOutput:
        """The output parser of one request; `tokenizer` is the engine's (text for the parser)."""
        gen = self.dr.ChatCompletionRequest.chunk_generator(prepared.conversation_request, request_id,
                                                            self.served_model_name)
        processor = self.dr.StreamProcessor(gen, prepared.conversation_request.parsing_options)
        return ChatOutput(self.dr, processor, request_id, self.served_model_name, prepared, tokenizer)


class ChatOutput:
    """One request's output parser: token ids in, Chat Completions chunks out (as JSON text when
    streaming; accumulated into one response otherwise).

    The parser is fed text with its token count, not token ids: given ids, the recipe counts
    `completion_tokens` per decoded piece, so ids that end inside a UTF-8 character are not counted.
    Text is decoded incrementally (held back inside a character); at the end the rest of the full
    decode is sent, so the parser sees exactly `decode(all ids)` (special tokens such as EOS left
    out; DeepSeek's chat and tool markers are not special and stay in)."""

    def __init__(self, dr: Any, processor: Any, request_id: str, model: str, prepared: PreparedChat,
                 tokenizer: Any):
        self.dr = dr
        self.processor = processor
        self.prepared = prepared
        self.tokenizer = tokenizer
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=True)
        self.token_ids: list[int] = []
        self.sent_text = ""
        self.uncounted = 0  # tokens whose text the parser has not been given yet
        self.closed = False
        n = len(prepared.prompt_token_ids)
        self.response = None if prepared.stream else dr.ChatCompletionResponse(request_id, model, int(time.time()),
                                                                               n, 0)
        # the role chunk, sent with the first tokens
        self._first = self._emit(processor.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=n))))

    def _emit(self, chunks: list[Any]) -> list[str]:
        if self.response is not None:
            for c in chunks:
                self.response.accumulate(c)
            return []
        out = [c.to_json() for c in chunks]
        if not self.prepared.include_usage:  # OpenAI sends usage only when stream_options ask for it
            out = [_without_usage(s) for s in out]
        return out

    def _with_first(self, chunks: list[str]) -> list[str]:
        first, self._first = self._first, []
        return first + chunks

    def _text(self, text: str) -> list[Any]:
        if self.processor.finished:  # it saw a stop sequence: the rest of the output is dropped
            return []
        n, self.uncounted = self.uncounted, 0
        self.sent_text += text
        return self.processor.push(self.dr.InferenceChunk.text(text, n))

    def push(self, token_ids: list[int]) -> list[str]:
        self.token_ids += token_ids
        self.uncounted += len(token_ids)
        text = self.decoder.push(token_ids) if token_ids else ""
        return self._with_first(self._emit(self._text(text) if text else []))

    def finish(self, reason: str) -> list[str]:
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        # the incremental text is a prefix of the full decode, bar bytes it held back that decode
        # to replacement characters; send whatever the parser has not seen
        rest = full[len(self.sent_text):] if full.startswith(self.sent_text) else ""
        chunks = self._text(rest) if rest or self.uncounted else []
        fr = self.dr.InferenceFinishReason.Length if reason == "length" else self.dr.InferenceFinishReason.Stop
        if not self.processor.finished:
            chunks += self.processor.push(self.dr.InferenceChunk.finish(fr)) + self.processor.finish()
        return self._with_first(self._emit(chunks))

    def push_delta(self, delta: Any) -> list[str]:
        return self.push(delta.token_ids)

    def close(self) -> None:
        """Release the parser (idempotent; nothing to do once it finished)."""
        if not self.processor.finished and not self.closed:
            self.processor.close()
        self.closed = True

    def response_json(self) -> str:
        return self.response.to_json()


def _ebnf(tag: Any) -> dict[str, str]:
    import xgrammar as xgr

    return {"schema_type": "ebnf", "schema": str(xgr.Grammar.from_structural_tag(tag))}


def _without_usage(chunk_json: str) -> str:
    data = json.loads(chunk_json)
    if data.get("usage") is None:
        return chunk_json
    data["usage"] = None
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _recipe_message(e: Exception) -> str:
    """The message inside the recipe's OpenAI-style error body (else the exception's text)."""
    try:
        return json.loads(e.body)["error"]["message"]
    except Exception:
        return str(e)
