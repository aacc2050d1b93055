"""Image content parts of a chat request, loaded for the engine (docs/server.md, "Images").

`request_images(body, policy)` finds the image parts of a Chat Completions (`messages[i].content[j]`
of type `image_url`), Responses (`input[i].content[j]` of type `input_image`) or Anthropic Messages
(`messages[i].content[j]` of type `image`, its `source` `{"type": "base64", "data"}` or
`{"type": "url", "url"}`) body, in the order the chat encoding renders their placeholders, and loads
each into a PIL image:

* a `data:` URL is decoded;
* an `http://` or `https://` URL is fetched only when its host is in the server's allow-list
  (`MediaPolicy.allowed_domains`, `--allowed-media-domains`; empty by default: fetching is off),
  with a timeout, at most `max_image_bytes` read, and a redirect followed only to an allowed host;
* a `file:` URL is read only when the file, symlinks resolved, lies under
  `MediaPolicy.allowed_local_path` (`--allowed-local-media-path`; none by default: local files are off).

Every problem is a `RequestError` (400) naming the part: a URL of another kind, a host or path not
allowed, a fetch that fails, data that is not base64 or not an image Pillow reads, more than
`max_images` images, an image over `max_image_bytes` or `max_image_pixels` (checked from the
header, before the pixels are decoded: decompression bombs).
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from deepinfer.server.chat_format import RequestError

MAX_IMAGES = 16  # per request
MAX_IMAGE_BYTES = 20 * 2**20  # encoded, per image
MAX_IMAGE_PIXELS = 40_000_000  # per image (the size plan shrinks it to at most 1,024 positions anyway)
FETCH_TIMEOUT_S = 10.0
_PART_TYPES = {"messages": ("image_url", "image"), "input": ("input_image",)}


@dataclass(frozen=True)
class MediaPolicy:
    """What the server loads for image parts, and the limits (the `--allowed-media-domains`,
    `--allowed-local-media-path`, `--max-image-*` and `--media-fetch-timeout` flags)."""

    allowed_domains: tuple[str, ...] = ()  # hosts whose http(s) URLs are fetched (exact names, lower case)
    allowed_local_path: str | None = None  # a folder (resolved) whose files `file:` URLs may name
    max_images: int = MAX_IMAGES
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    fetch_timeout_s: float = FETCH_TIMEOUT_S

    @classmethod
    def from_settings(cls, settings: Any) -> MediaPolicy:
        """The policy of a `ServerSettings`."""
        local = settings.allowed_local_media_path
        return cls(allowed_domains=tuple(settings.allowed_media_domains),
                   allowed_local_path=None if local is None else os.path.realpath(local),
                   max_images=settings.max_images_per_prompt, max_image_bytes=settings.max_image_bytes,
                   max_image_pixels=settings.max_image_pixels, fetch_timeout_s=settings.media_fetch_timeout_s)


#: a 1x1 grey PNG: what the chat renderer sees in place of an image URL the server loaded itself
#: (it renders a placeholder per image part and accepts only inline images it can check)
_INLINE_STAND_IN = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGOor68HAAL"
                    "+AX66JXAlAAAAAElFTkSuQmCC")


def for_renderer(body: Any) -> Any:
    """`body` with each image part's http(s) or file: URL replaced by an inline stand-in (a copy
    where one is replaced; `body` itself otherwise): the server loaded those images already, and the
    renderer only places their placeholders."""
    if not any(isinstance(_url(part), str) and not _url(part).startswith("data:") for _, part in image_parts(body)):
        return body
    out = dict(body)
    for key in _PART_TYPES:
        if isinstance(out.get(key), list):
            out[key] = map_content_parts(out[key], _stand_in)
    return out


def map_content_parts(turns: list, change: Any) -> list:
    """`turns` (messages or Responses input items) with `change(part)` in place of each part of a
    list content (copies of the turns it touches; the others as they are)."""
    out = []
    for turn in turns:
        contents = turn.get("content") if isinstance(turn, dict) else None
        out.append(dict(turn, content=[change(part) for part in contents]) if isinstance(contents, list) else turn)
    return out


def _url(part: dict) -> Any:
    """The part's URL (an Anthropic base64 source as a data: URL), or what stands where it should be."""
    if part.get("type") == "image":
        source = part.get("source")
        if not isinstance(source, dict):
            return None
        if source.get("type") == "base64":
            return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
        return source.get("url") if source.get("type") == "url" else None
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url


def _stand_in(part: Any) -> Any:
    if not isinstance(part, dict) or part.get("type") not in ("image_url", "input_image", "image"):
        return part
    url = _url(part)
    if not isinstance(url, str) or url.startswith("data:"):
        return part
    if part.get("type") == "image":
        media, _, data = _INLINE_STAND_IN[5:].partition(";base64,")
        return dict(part, source={"type": "base64", "media_type": media, "data": data})
    if isinstance(part.get("image_url"), dict):
        return dict(part, image_url=dict(part["image_url"], url=_INLINE_STAND_IN))
    return dict(part, image_url=_INLINE_STAND_IN)


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


def request_images(body: Any, policy: MediaPolicy | None = None) -> list[Any]:
    """The PIL images of `body`'s image parts, in order (module docstring)."""
    policy = policy or MediaPolicy()
    parts = image_parts(body)
    if len(parts) > policy.max_images:
        raise RequestError(400, f"{parts[policy.max_images][0]}: a request may hold at most {policy.max_images} "
                                f"images; got {len(parts)}")
    return [_load(path, part, policy) for path, part in parts]


def _shown(url: str) -> str:
    return url if len(url) <= 60 else url[:57] + "..."


def _load(path: str, part: dict, policy: MediaPolicy) -> Any:
    url = _url(part)
    if not isinstance(url, str) or not url:
        if part.get("type") == "image":
            raise RequestError(400, f"{path}: an image part needs a source: {{\"type\": \"base64\", \"media_type\", "
                                    f"\"data\"}}, or {{\"type\": \"url\", \"url\"}} with an http(s) or file: URL the "
                                    f"server allows")
        raise RequestError(400, f"{path}: an image part needs image_url (a data: URL, or an http(s) or file: URL "
                                f"the server allows)")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url(path, url)
    elif scheme in ("http", "https"):
        data = _fetch(path, url, policy)
    elif scheme == "file":
        data = _local_file(path, url, policy)
    else:
        raise RequestError(400, f"{path}: image URL {_shown(url)!r} is not a data:, http(s) or file: URL; send the "
                                f"image inline as a data: URL (data:image/png;base64,...)")
    if len(data) > policy.max_image_bytes:
        raise RequestError(400, f"{path}: the image has {len(data)} bytes, more than the limit of "
                                f"{policy.max_image_bytes}")
    return _open(path, data, policy)


def _data_url(path: str, url: str) -> bytes:
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise RequestError(400, f"{path}: the data: URL has no ',' before its data")
    try:
        return (base64.b64decode(payload, validate=True) if header.endswith(";base64")
                else urllib.parse.unquote_to_bytes(payload))
    except (binascii.Error, ValueError):
        raise RequestError(400, f"{path}: the data: URL's data is not valid base64") from None


def _host_problem(url: str, policy: MediaPolicy) -> str | None:
    """Why `url` may not be fetched, or None."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        return f"{_shown(url)!r} is not an http(s) URL"
    host = (parts.hostname or "").lower()
    if not policy.allowed_domains:
        return (f"image URL {_shown(url)!r} is not fetched (fetching http(s) image URLs is off; the server fetches "
                f"them only from the domains of --allowed-media-domains); send the image inline as a data: URL "
                f"(data:image/png;base64,...)")
    if host not in policy.allowed_domains:
        return (f"image URL host {host!r} is not in the server's allowed media domains "
                f"({', '.join(policy.allowed_domains)}); send the image inline as a data: URL")
    return None


class _AllowedRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to a URL the policy allows (else it would escape the allow-list)."""

    def __init__(self, path: str, policy: MediaPolicy):
        self.path, self.policy = path, policy

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        problem = _host_problem(newurl, self.policy)
        if problem is not None:
            raise RequestError(400, f"{self.path}: the image URL redirects to {_shown(newurl)!r}, which is not "
                                    f"allowed: {problem}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(path: str, url: str, policy: MediaPolicy) -> bytes:
    problem = _host_problem(url, policy)
    if problem is not None:
        raise RequestError(400, f"{path}: {problem}")
    opener = urllib.request.build_opener(_AllowedRedirects(path, policy))
    request = urllib.request.Request(url, headers={"User-Agent": "deepinfer", "Accept": "image/*"})
    limit = policy.max_image_bytes
    try:
        with opener.open(request, timeout=policy.fetch_timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limit:
                raise RequestError(400, f"{path}: the image at {_shown(url)!r} has {int(length)} bytes, more than "
                                        f"the limit of {limit}")
            return response.read(limit + 1)
    except RequestError:
        raise
    except urllib.error.HTTPError as e:
        raise RequestError(400, f"{path}: fetching the image URL {_shown(url)!r} failed: HTTP {e.code} "
                                f"{e.reason}") from None
    except urllib.error.URLError as e:
        raise RequestError(400, f"{path}: the image URL {_shown(url)!r} cannot be fetched ({e.reason})") from None
    except (OSError, ValueError) as e:  # timeouts, connection resets, malformed URLs
        raise RequestError(400, f"{path}: the image URL {_shown(url)!r} cannot be fetched "
                                f"({type(e).__name__}: {e})") from None


def _local_file(path: str, url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise RequestError(400, f"{path}: local image files ({_shown(url)!r}) are off; the server reads them only "
                                f"under --allowed-local-media-path; send the image inline as a data: URL")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise RequestError(400, f"{path}: a file: URL names a file of this machine (file:///path); got host "
                                f"{parts.netloc!r}")
    real = os.path.realpath(urllib.parse.unquote(parts.path))
    root = policy.allowed_local_path
    if os.path.commonpath([real, root]) != root:
        raise RequestError(400, f"{path}: {_shown(url)!r} is not under the server's allowed local media path "
                                f"(--allowed-local-media-path); send the image inline as a data: URL")
    if not os.path.isfile(real):
        raise RequestError(400, f"{path}: {_shown(url)!r} is not a file")
    size = os.path.getsize(real)
    if size > policy.max_image_bytes:
        raise RequestError(400, f"{path}: the image has {size} bytes, more than the limit of "
                                f"{policy.max_image_bytes}")
    try:
        with open(real, "rb") as f:
            return f.read(policy.max_image_bytes + 1)
    except OSError as e:
        raise RequestError(400, f"{path}: {_shown(url)!r} cannot be read ({type(e).__name__})") from None


def _open(path: str, data: bytes, policy: MediaPolicy) -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise RequestError(400, f"{path}: this server cannot read images (Pillow is not installed: pip install "
                                f"pillow)") from None
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > policy.max_image_pixels:
            raise RequestError(400, f"{path}: the image is {width}x{height} pixels, more than the limit of "
                                    f"{policy.max_image_pixels} pixels")
        image.load()
        return image.convert("RGB")
    except RequestError:
        raise
    except Exception as e:  # Pillow raises many kinds for bad data (UnidentifiedImageError, OSError, ...)
        raise RequestError(400, f"{path}: the image cannot be read ({type(e).__name__}: {e})") from None
