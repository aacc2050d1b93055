"""Image prompts: `{"prompt": ..., "multi_modal_data": {"image": PIL.Image | [PIL.Image, ...]}}`.

The prompt holds one image placeholder (the model's `image_token_id`, 129264 for DeepSeek-V4.1,
which deepseek-recipe's V4.1 chat encoding spells `<｜image｜>`) where each image goes, in order;
admission keys on the id, not on a spelling. Admission (`expand_images`) preprocesses
each image with the model (`preprocess_image`: its size plan gives the span's length before any
compute) and replaces its placeholder by the image's whole span of placeholder ids, so
`max_model_len` and the token budget count the span. The request keeps the images
(`Request.images`); each step hands the model the spans that overlap its chunk (`step_images`),
so chunked prefill may split a span and a preempted request recomputes its images.

The prefix cache is keyed on the pixels, not on the placeholder ids: `Request.key_tokens` gives
each span position an id derived from the image's digest, so two requests with the same image
share a cached prefix and different images never do.

A model takes images when it has `image_input_unsupported` (None) and `preprocess_image`; every
other model (DeepSeek-V4, a text-only V4.1 checkpoint) refuses them with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.models.batch import ImageSpan


@dataclass(frozen=True)
class PromptImage:
    """One image of a request's prompt: its span starts at prompt position `start`."""

    start: int
    image: Any  # the model's preprocessed image (`num_tokens`, `digest`)

    @property
    def end(self) -> int:
        return self.start + self.image.num_tokens


def image_refusal(model: Any) -> str | None:
    """Why `model` does not take image input, or None when it does."""
    if not hasattr(model, "preprocess_image"):
        return (f"this model ({type(model).__name__}) does not take image input; send text only "
                f"(image prompts need a DeepSeek-V4.1 checkpoint with its vision tower)")
    return model.image_input_unsupported


def _as_images(value: Any) -> tuple[list[Any] | None, str | None]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    try:
        from PIL.Image import Image
    except ImportError:
        return None, "image input needs Pillow (pip install pillow)"
    for i, item in enumerate(items):
        if not isinstance(item, Image):
            return None, (f'multi_modal_data["image"][{i}] is a {type(item).__name__}, not a PIL.Image.Image; '
                          f"open the image with PIL.Image.open(...)")
    return items, None


def expand_images(token_ids: list[int], data: Any, model: Any
                  ) -> tuple[list[int], tuple[PromptImage, ...], str | None]:
    """(the prompt with each placeholder expanded to its image's span, the images, the problem
    or None). `data`: the prompt's `multi_modal_data`."""
    if not isinstance(data, dict) or set(data) - {"image"}:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        return token_ids, (), f'multi_modal_data must be a dict with the key "image" only; got {keys}'
    value = data.get("image")
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return token_ids, (), None
    refusal = image_refusal(model)
    if refusal is not None:
        return token_ids, (), refusal
    images, problem = _as_images(data["image"])
    if problem is not None:
        return token_ids, (), problem
    placeholder = model.image_token_id
    found = token_ids.count(placeholder)
    if found != len(images):
        return token_ids, (), (f"the prompt has {found} image placeholders (token id {placeholder}) but "
                               f"multi_modal_data has {len(images)} images; put one placeholder where each image "
                               f"goes")
    out: list[int] = []
    spans = []
    pending = iter(images)
    for token in token_ids:
        if token != placeholder:
            out.append(token)
            continue
        index = len(spans)
        try:
            image = model.preprocess_image(next(pending))
        except (ValueError, OSError) as e:
            return token_ids, (), f"image {index} cannot be used: {e}"
        spans.append(PromptImage(len(out), image))
        out += [placeholder] * image.num_tokens
    return out, tuple(spans), None


def key_tokens(tokens: list[int], start: int, images: tuple[PromptImage, ...]) -> list[int]:
    """`tokens` (positions start.. of a prompt) with each image span position replaced by an id
    derived from the image's digest and the position in the span (negative: never a token id)."""
    out = list(tokens)
    end = start + len(out)
    for item in images:
        base = int(item.image.digest[:15], 16)
        for p in range(max(item.start, start), min(item.end, end)):
            out[p - start] = -1 - ((base + p - item.start) % (1 << 62))
    return out


def step_images(scheduled: list[Any]) -> list[ImageSpan] | None:
    """The image spans overlapping each scheduled chunk (sequence index = position in `scheduled`)."""
    spans = [ImageSpan(i, item.start, item.image) for i, s in enumerate(scheduled)
             for item in s.request.images
             if item.start < s.context_len + s.query_len and item.end > s.context_len]
    return spans or None
