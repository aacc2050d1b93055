"""Sample prompts of `offline_inference.py` (text only; this engine has no vision input)."""
from __future__ import annotations

from typing import Any

#: (prompt, sampling overrides) - a mix of greedy and seeded sampling, short and longer outputs.
SAMPLES: list[tuple[str, dict[str, Any]]] = [
    ("The capital of France is", {"temperature": 0.0}),
    ("Write a haiku about the sea.", {"temperature": 0.6, "top_p": 0.95, "seq_seed": 1}),
    ("Explain in one sentence why the sky is blue.", {"temperature": 0.0}),
    ("List three prime numbers greater than 100:", {"temperature": 0.8, "top_k": 50, "seq_seed": 2}),
]

#: --long_context: input and output tokens per sample (as in the seeds; --long_context_input_tokens /
#: --long_context_output_tokens change them, e.g. to fit a small model).
LONG_CONTEXT_INPUT_TOKENS = 16389
LONG_CONTEXT_OUTPUT_TOKENS = 4096
DEFAULT_OUTPUT_TOKENS = 32

_FILLER = ("In the beginning the engine read every token of the prompt, and then it wrote a story about "
           "the sea, the wind, the stars and the long road home. ")


def prepare_offline_prompts(tokenizer, long_context: bool = False, greedy: bool = False,
                            input_tokens: int = LONG_CONTEXT_INPUT_TOKENS,
                            output_tokens: int = LONG_CONTEXT_OUTPUT_TOKENS) -> tuple[list[Any], list]:
    """The prompts and one `SamplingParams` per prompt.

    With `long_context`, each prompt is padded with filler text to exactly `input_tokens` tokens
    (given as token ids, with the text kept for display) and generates up to `output_tokens`.
    With `greedy`, every sample decodes greedily (the perplexity baselines in tests/models)."""
    from deepinfer.sampling_params import SamplingParams

    max_tokens = output_tokens if long_context else DEFAULT_OUTPUT_TOKENS
    prompts: list[Any] = []
    params = []
    for text, overrides in SAMPLES:
        params.append(SamplingParams(max_tokens=max_tokens, **({"temperature": 0.0} if greedy else overrides)))
        if not long_context:
            prompts.append(text)
            continue
        bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
        question = tokenizer.encode(text)
        filler = tokenizer.encode(_FILLER)
        body_len = input_tokens - len(bos) - len(question)
        body = (filler * (body_len // len(filler) + 1))[:body_len]
        ids = bos + body + question
        prompts.append({"prompt_token_ids": ids, "prompt": f"[{len(body)} filler tokens] {text}"})
    return prompts, params
