"""Reading a request body: its size and time limits, and JSON that every later stage can take.

`read_json` refuses, with a 4xx that names the problem (and where in the body it is):

- a body larger than `--max-body-bytes` (413, from Content-Length or while reading);
- a body that does not arrive within `--body-timeout` seconds, e.g. one shorter than its
  Content-Length (408; the connection is closed, as its framing is lost);
- text that is not JSON, or JSON that is not an object; `NaN` / `Infinity` (not JSON numbers);
- JSON nested more than `MAX_JSON_DEPTH` levels (deepseek-recipe's parser stops there);
- an integer outside 64 bits (the recipe's parser cannot hold it);
- a string with a lone surrogate (`"\\ud800"`: valid JSON syntax, but no Unicode text).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request

from deepinfer.server.chat_format import RequestError

#: levels of nested objects and arrays a body may have (the top-level object is level 1)
MAX_JSON_DEPTH = 128
INT_MIN, INT_MAX = -2**63, 2**64 - 1  # what a 64-bit integer, signed or not, can hold


class BodyTimeout(RequestError):
    """The body did not arrive in time; the answer closes the connection."""

    def __init__(self, message: str):
        super().__init__(408, message, "timeout")


async def read_json(request: Request, *, max_bytes: int, timeout_s: float) -> dict[str, Any]:
    """The request body as a JSON object, or a RequestError (see the module docstring)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(413, f"request body of {declared} bytes is larger than the limit of {max_bytes} bytes")
    body = bytearray()

    async def receive() -> None:
        async for piece in request.stream():
            body.extend(piece)
            if len(body) > max_bytes:
                raise RequestError(413, f"request body is larger than the limit of {max_bytes} bytes")

    try:
        await asyncio.wait_for(receive(), timeout_s)
    except asyncio.TimeoutError:
        expected = f" of the {declared} bytes its Content-Length announced" if declared is not None else ""
        raise BodyTimeout(f"the request body did not arrive within {timeout_s:g} s (received {len(body)} bytes"
                          f"{expected})") from None
    try:
        data = json.loads(body, parse_constant=_not_a_number)
    except RecursionError:
        raise RequestError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise RequestError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise RequestError(400, "the request body must be a JSON object")
    problem = json_problem(data)
    if problem is not None:
        raise RequestError(400, problem)
    return data


def json_problem(data: Any) -> str | None:
    """What makes parsed JSON unfit for the server (too deep, an integer or a string no later stage
    can take), with where it is; None when it is fit. Walks the value without recursion."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            return (f"{_where(path)}: the request body nests deeper than {MAX_JSON_DEPTH} levels "
                    f"(objects and arrays inside each other)")
        for key, child in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(key, str) and (problem := _string_problem(key)) is not None:
                return f"{_where(path)}: a key {problem}"
            if isinstance(child, (dict, list)):
                stack.append((child, (*path, key)))
            elif (problem := _scalar_problem(child)) is not None:
                return f"{_where((*path, key))}: {problem}"
    return None


def _scalar_problem(value: Any) -> str | None:
    if isinstance(value, str):
        return _string_problem(value)
    if isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
        digits = str(abs(value))
        shown = value if len(digits) <= 40 else f"with {len(digits)} digits"
        return f"the integer {shown} is outside the 64-bit range [-2^63, 2^64)"
    return None


def _string_problem(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        # the escaped form: the character itself cannot be written into the (UTF-8) answer
        return (f"contains a lone surrogate ({text[e.start]!r}) at character {e.start}; JSON strings must be "
                f"valid Unicode text")
    return None


def _where(path: tuple[Any, ...]) -> str:
    """`messages.0.content`; a long path is cut after its first six steps."""
    if not path:
        return "body"
    shown = ".".join(str(p) for p in path[:6])
    return shown + (f"... ({len(path)} levels)" if len(path) > 6 else "")


def _not_a_number(constant: str) -> float:
    raise ValueError(f"{constant} is not a JSON number")
