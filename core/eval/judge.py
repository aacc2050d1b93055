"""An LLM judge through any OpenAI-compatible endpoint, for answers exact match cannot score (HLE's
short answers).

The judge gets the question, the model's answer and the correct answer, and must answer in a JSON
schema (`response_format: json_schema`, which `deepinfer serve` enforces with its structured-output
feature): the final answer it extracted, its reasoning, whether that answer is correct (yes/no) and
the confidence the response stated. The prompt follows the structure of HLE's own judge; a
different wording (HLE's exact text, for instance) can be given as a file with the placeholders
{question}, {response} and {correct_answer}.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer.eval.backends import Endpoint, EndpointError
from deepinfer.eval.rows import fingerprint

JUDGE_PROMPT = """Decide whether the [response] to the [question] below gives the [correct_answer]; judge only that.

[question]: {question}

[response]: {response}

[correct_answer]: {correct_answer}

Answer with these fields:
extracted_final_answer: the final answer the response commits to, copied exactly; 'None' if it gives no final answer.
reasoning: why the extracted answer does or does not match the correct answer. Compare the two answers only: do not \
solve the problem yourself and do not argue for another answer.
correct: 'yes' if the extracted answer matches the correct answer, or differs only by a small margin for a numerical \
answer; 'no' for anything else (a different, inconsistent, ambiguous or missing answer).
confidence: the confidence between 0 and 100 the response states; 100 if it states none."""

def verdict_schema(answer_chars: int, reasoning_chars: int) -> dict[str, Any]:
    """What the judge must answer; the strings are bounded so that a constrained judge always ends."""
    return {
        "type": "object",
        "properties": {
            "extracted_final_answer": {"type": "string", "maxLength": answer_chars},
            "reasoning": {"type": "string", "maxLength": reasoning_chars},
            "correct": {"type": "string", "enum": ["yes", "no"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["extracted_final_answer", "reasoning", "correct", "confidence"],
        "additionalProperties": False,
    }


class Verdict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    extracted_final_answer: str
    reasoning: str
    correct: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=100)


class JudgeError(RuntimeError):
    """The judge could not be asked, or did not answer in the schema."""


class Judge:
    """Asks `model` at `endpoint` (temperature 0) to judge one answer; `extra_body` is merged into
    each request (e.g. `{"thinking": {"type": "disabled"}}` for a DeepSeek judge). The verdict's
    extracted answer and reasoning are bounded to `answer_chars` and `reasoning_chars` characters."""

    def __init__(self, endpoint: Endpoint, model: str, prompt: str = JUDGE_PROMPT, max_tokens: int = 4096,
                 extra_body: dict[str, Any] | None = None, answer_chars: int = 1000, reasoning_chars: int = 4000):
        for field in ("{question}", "{response}", "{correct_answer}"):
            if field not in prompt:
                raise ValueError(f"the judge prompt must contain the placeholder {field}")
        self.endpoint, self.model, self.prompt, self.max_tokens = endpoint, model, prompt, max_tokens
        self.extra_body = dict(extra_body or {})
        self.schema = verdict_schema(answer_chars, reasoning_chars)

    def describe(self) -> dict[str, Any]:
        """What identifies this judge's verdicts (recorded with each score)."""
        return {"url": self.endpoint.base_url, "model": self.model,
                "prompt": fingerprint({"prompt": self.prompt, "schema": self.schema}), "extra_body": self.extra_body}

    def body(self, question: str, response: str, correct_answer: str) -> dict[str, Any]:
        text = self.prompt.replace("{question}", question).replace("{response}", response) \
            .replace("{correct_answer}", correct_answer)
        return {"model": self.model, "messages": [{"role": "user", "content": text}], "temperature": 0.0,
                "max_tokens": self.max_tokens, "stream": False,
                "response_format": {"type": "json_schema", "json_schema": {"name": "verdict", "schema": self.schema}},
                **self.extra_body}

    def judge(self, question: str, response: str, correct_answer: str) -> Verdict:
        try:
            answer = self.endpoint.chat(self.body(question, response, correct_answer))
            content = answer["choices"][0]["message"]["content"]
        except EndpointError as e:
            raise JudgeError(f"the judge could not be asked: {e}") from None
        except (KeyError, IndexError, TypeError):
            raise JudgeError(f"the judge's answer is not a chat completion: {json.dumps(answer)[:300]}") from None
        try:
            return Verdict.model_validate_json(content or "")
        except ValidationError as e:
            raise JudgeError(f"the judge did not answer in the verdict schema ({e.errors()[0]['msg']}): "
                             f"{(content or '')[:300]!r}") from None
