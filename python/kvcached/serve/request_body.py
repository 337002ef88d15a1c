"""A routed request's body as the router reads it: bounded in size while it arrives, and its ``model``.

The body is passed to the engine byte for byte; the router only needs its ``model``. It is read
up to :data:`MAX_BODY_BYTES` (a declared ``Content-Length`` above that is refused before a byte
is read, a chunked body as soon as it passes it), so a client cannot make the router buffer
without end. Parsing it may meet anything a client sends: a body nested thousands of levels deep
is a 400 like any other malformed body, never a RecursionError.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from kvcached.errors import KvcachedError

#: Far above any text prompt (a 128k-token prompt is about 1 MiB of JSON) and room for a few images.
MAX_BODY_BYTES = 32 * 1024 * 1024


class BadBody(KvcachedError, ValueError):
    """A body the router refuses: the HTTP status and the OpenAI error's message, code and param."""

    def __init__(self, status: int, message: str, code: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


async def read_body(request: Any, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The whole body of ``request`` (a Starlette request), at most ``max_bytes``; BadBody (413) past that."""
    too_large = BadBody(
        413,
        f"the request body is larger than {max_bytes // (1024 * 1024)} MiB, the most kvcached serve accepts",
        "request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        parts.append(chunk)
    return b"".join(parts)


def model_of(body: bytes) -> str:
    """The ``model`` a body names; BadBody (400) when it is not a JSON object naming one by a string."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack allows
        raise BadBody(400, "the request body is not valid JSON", "invalid_json") from None
    if not isinstance(payload, dict):
        raise BadBody(400, "the request body is not a JSON object", "invalid_json")
    if "model" not in payload:
        raise BadBody(400, "the request names no `model`", "model_missing", "model")
    model = payload["model"]
    if not isinstance(model, str):
        raise BadBody(400, f"`model` must be a string, not {_json_kind(model)}", "model_not_string", "model")
    return model


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "an array" if isinstance(value, list) else "an object"


__all__ = ["MAX_BODY_BYTES", "BadBody", "model_of", "read_body"]
