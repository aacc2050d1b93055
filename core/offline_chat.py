"""`LLM.chat`: conversations rendered with the model's DeepSeek chat encoding, images included.

The rendering is the server's (`deepinfer.server.chat_format`, through the `deepseek-recipe`
package of the `serve` extra), so an offline conversation and the same one sent to `deepinfer
serve` give the engine the same prompt. Messages are OpenAI-style dicts; a message's content may be
a string or a list of parts: `text`, `image_url` (a `data:` URL, or a `file:` URL under
`allowed_local_media_path`; http(s) URLs are not fetched offline) and vLLM's offline `image_pil`
(`{"type": "image_pil", "image_pil": PIL.Image}`). Each image becomes its span in the prompt
(docs/vision.md).
"""
from __future__ import annotations

import base64
import io
import os
from typing import Any

OFFLINE_MODEL_NAME = "deepinfer-offline"


def as_conversations(messages: Any) -> list[list[dict]]:
    """One conversation (a list of message dicts) or several, as a list of conversations."""
    if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
        return [list(messages)]
    if isinstance(messages, (list, tuple)) and messages and all(isinstance(c, (list, tuple)) for c in messages):
        return [list(c) for c in messages]
    raise TypeError("LLM.chat takes a conversation (a non-empty list of message dicts, "
                    "[{'role': 'user', 'content': ...}]) or a list of conversations")


def _inline_pil(part: Any) -> Any:
    """An `image_pil` part as an `image_url` part with a PNG data: URL (the renderer's input)."""
    if not (isinstance(part, dict) and part.get("type") == "image_pil"):
        return part
    image = part.get("image_pil")
    if not hasattr(image, "save"):
        raise ValueError(f"an image_pil part needs a PIL image; got {type(image).__name__}")
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


class OfflineChat:
    """The chat renderer of one `LLM` (thinking on or off), its prompts ready for `generate`."""

    def __init__(self, llm: Any, thinking: bool, allowed_local_media_path: str | None = None):
        try:
            from deepinfer.server.chat_format import ChatFormat, tokenizer_file
            from deepinfer.server.images import MediaPolicy
        except ImportError as e:
            raise RuntimeError(f"LLM.chat renders DeepSeek chat messages with the package 'deepseek-recipe' ({e}); "
                               f"install it: pip install 'deepinfer[serve]'") from None
        self.format = ChatFormat(model_type=llm.build_info.model_type, tokenizer_file=tokenizer_file(llm.tokenizer),
                                 served_model_name=OFFLINE_MODEL_NAME, max_model_len=llm.engine.max_model_len,
                                 default_thinking=thinking)
        if self.format.unavailable is not None:
            raise ValueError(f"LLM.chat cannot render chat messages for this model: {self.format.unavailable}")
        local = None if allowed_local_media_path is None else os.path.realpath(allowed_local_media_path)
        self.format.media = MediaPolicy(allowed_local_path=local)
        self.image_refusal = llm.image_input_unsupported

    def prompt(self, conversation: list[dict], index: int) -> list[int] | dict[str, Any]:
        """The engine prompt of one conversation; ValueError naming the conversation and the problem."""
        from deepinfer.server.chat_format import RequestError
        from deepinfer.server.images import image_parts, map_content_parts

        try:
            body = {"model": OFFLINE_MODEL_NAME, "messages": map_content_parts(conversation, _inline_pil)}
            parts = image_parts(body) if self.image_refusal is not None else []
            if parts:
                raise ValueError(f"{parts[0][0]}: {self.image_refusal}")
            return self.format.prepare(body).engine_prompt
        except (RequestError, ValueError) as e:
            raise ValueError(f"conversation {index}: {getattr(e, 'message', e)}") from None
