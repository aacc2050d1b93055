"""Image content parts of a chat request, decoded for the engine (docs/server.md, "Images").

`request_images(body)` finds the image parts of a Chat Completions (`messages[i].content[j]` of type
`image_url`) or Responses (`input[i].content[j]` of type `input_image`) body, in the order the chat
encoding renders their placeholders, and decodes each `data:` URL into a PIL image. Every problem
is a `RequestError` (400) naming the part: a URL that is not a `data:` URL (fetching is off), a
body that is not base64 or not an image Pillow reads, more than `MAX_IMAGES` images, an image over
`MAX_IMAGE_BYTES` or `MAX_IMAGE_PIXELS` (checked from the header, before the pixels are decoded:
decompression bombs). Anthropic Messages' `image` parts are refused (not served yet).
"""
from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
from typing import Any

from deepinfer.server.chat_format import RequestError

MAX_IMAGES = 16  # per request
MAX_IMAGE_BYTES = 20 * 2**20  # encoded, per image
MAX_IMAGE_PIXELS = 40_000_000  # per image (the size plan shrinks it to at most 1,024 positions anyway)
_PART_TYPES = {"messages": ("image_url", "image"), "input": ("input_image",)}


def image_parts(body: Any) -> list[tuple[str, dict]]:
    """(path, part) of each image content part of `body`, in order."""
    found = []
    if not isinstance(body, dict):
        return found
    for key, types in _PART_TYPES.items():
        turns = body.get(key)
        for i, turn in enumerate(turns if isinstance(turns, list) else ()):
            parts = turn.get("content") if isinstance(turn, dict) else None
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                if isinstance(part, dict) and part.get("type") in types:
                    found.append((f"{key}[{i}].content[{j}]", part))
    return found


def request_images(body: Any) -> list[Any]:
    """The decoded PIL images of `body`'s image parts, in order (module docstring)."""
    parts = image_parts(body)
    if len(parts) > MAX_IMAGES:
        raise RequestError(400, f"{parts[MAX_IMAGES][0]}: a request may hold at most {MAX_IMAGES} images; got "
                                f"{len(parts)}")
    return [_decode(path, part) for path, part in parts]


def _decode(path: str, part: dict) -> Any:
    if part.get("type") == "image":
        raise RequestError(400, f"{path}: image content parts of /v1/messages are not served yet; send the image "
                                f"to /v1/chat/completions as an image_url data: URL")
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise RequestError(400, f"{path}: an image part needs image_url (a data: URL)")
    if not url.startswith("data:"):
        shown = url if len(url) <= 60 else url[:57] + "..."
        raise RequestError(400, f"{path}: image URL {shown!r} is not fetched (fetching image URLs is off); send the "
                                f"image inline as a data: URL (data:image/png;base64,...)")
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise RequestError(400, f"{path}: the data: URL has no ',' before its data")
    try:
        data = (base64.b64decode(payload, validate=True) if header.endswith(";base64")
                else urllib.parse.unquote_to_bytes(payload))
    except (binascii.Error, ValueError):
        raise RequestError(400, f"{path}: the data: URL's data is not valid base64") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise RequestError(400, f"{path}: the image has {len(data)} bytes, more than the limit of {MAX_IMAGE_BYTES}")
    return _open(path, data)


def _open(path: str, data: bytes) -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise RequestError(400, f"{path}: this server cannot read images (Pillow is not installed: pip install "
                                f"pillow)") from None
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise RequestError(400, f"{path}: the image is {width}x{height} pixels, more than the limit of "
                                    f"{MAX_IMAGE_PIXELS} pixels")
        image.load()
        return image.convert("RGB")
    except RequestError:
        raise
    except Exception as e:  # Pillow raises many kinds for bad data (UnidentifiedImageError, OSError, ...)
        raise RequestError(400, f"{path}: the image cannot be read ({type(e).__name__}: {e})") from None
