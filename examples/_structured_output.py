"""Structured-output samples (regex, JSON schema, EBNF) and the checks that validate their outputs.

Used by `offline_inference.py --check_structured_output`: every output must satisfy its constraint
*and* end on EOS, otherwise the run fails. The validators are independent of the engine's grammar
machinery: the regex is re-matched with Python's `re`, the JSON is parsed with the strict
`json.loads` and validated with `jsonschema`, and the EBNF is re-matched character by character
with an xgrammar matcher that knows nothing of the model's tokenizer.
"""
from __future__ import annotations

import json
import re
from typing import Any

SAMPLE_JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["color", "count"],
    "additionalProperties": False,
}

#: (prompt, so_args) of the three sample constraints; the JSON schema goes in as json.dumps(...).
SAMPLES: list[tuple[str, dict[str, Any]]] = [
    ("Invent a product code: two capital letters, a dash, three digits. Code:",
     {"schema_type": "regex", "schema": r"[A-Z]{2}-[0-9]{3}"}),
    ("Pick a color (red, green or blue) and a count from 1 to 3, as JSON:",
     {"schema_type": "json", "schema": json.dumps(SAMPLE_JSON_SCHEMA)}),
    ("Answer yes or no, then give a level from 1 to 3:",
     {"schema_type": "ebnf", "schema": 'root ::= "answer=" ("yes" | "no") ";level=" [1-3]'}),
]


def sample_requests(max_tokens: int = 128, temperature: float = 0.0) -> tuple[list[str], list]:
    """The sample prompts and their `SamplingParams` (as in the seeds: greedy, 128 tokens)."""
    from deepinfer.sampling_params import SamplingParams

    prompts = [prompt for prompt, _ in SAMPLES]
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, so_args=dict(so_args))
              for _, so_args in SAMPLES]
    return prompts, params


# -- validators: None when `text` satisfies the constraint, else a sentence saying why not -----------


def validate_regex(pattern: str, text: str) -> str | None:
    if re.fullmatch(pattern, text) is None:
        return f"{text!r} does not fully match the regex {pattern!r}"
    return None


def validate_json(schema: str | dict, text: str) -> str | None:
    try:
        import jsonschema
    except ImportError:
        raise RuntimeError("validating JSON outputs needs the 'jsonschema' package: pip install jsonschema") from None
    try:
        value = json.loads(text)  # strict: raw control characters inside strings are an error
    except json.JSONDecodeError as e:
        return f"{text!r} is not valid JSON: {e}"
    try:
        jsonschema.validate(value, json.loads(schema) if isinstance(schema, str) else schema)
    except jsonschema.ValidationError as e:
        return f"{text!r} violates the JSON schema: {e.message}"
    return None


def validate_ebnf(grammar: str, text: str) -> str | None:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(["a"], vocab_size=1, stop_token_ids=[0])  # text-only matching needs no vocabulary
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    if not matcher.accept_string(text) or not matcher.is_completed():
        return f"{text!r} is not a complete sentence of the EBNF grammar {grammar!r}"
    return None


VALIDATORS = {"regex": validate_regex, "json": validate_json, "ebnf": validate_ebnf}


def validate(so_args: dict[str, Any], text: str) -> str | None:
    """Check `text` against a request's `so_args`."""
    return VALIDATORS[so_args["schema_type"]](so_args["schema"], text)


def check_outputs(params: list, outputs: list, eos_token_id: int | None, eos_text: str = "") -> list[str]:
    """Every violation in a batch of results: a constraint not satisfied, or generation that did
    not end on EOS (finish_reason "stop" with EOS as the last token). Empty when all is well."""
    problems = []
    for i, (p, out) in enumerate(zip(params, outputs)):
        so_args = getattr(p, "so_args", None)
        if not so_args:
            continue
        completion = out.outputs[0]
        label = f"request {i} ({so_args['schema_type']})"
        if completion.finish_reason in ("error", "grammar_dead_end"):
            problems.append(f"{label}: failed with finish_reason={completion.finish_reason!r}: {out.error}")
            continue
        ended_on_eos = (completion.finish_reason == "stop" and eos_token_id is not None
                        and bool(completion.token_ids) and completion.token_ids[-1] == eos_token_id)
        if not ended_on_eos:
            last = completion.token_ids[-1] if completion.token_ids else None
            problems.append(f"{label}: generation did not end on EOS (finish_reason={completion.finish_reason!r}, "
                            f"last token {last}, EOS {eos_token_id})")
        text = completion.text
        if eos_text and text.endswith(eos_text):
            text = text[: -len(eos_text)]
        problem = validate(so_args, text)
        if problem:
            problems.append(f"{label}: {problem}")
    return problems
