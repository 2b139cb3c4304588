"""Reading a request body under a size cap, and clients that leave while sending it.

``--max-body-bytes`` (default ``auto``: ``max(1 MiB, 128 bytes x the context length)``; a token
decodes to 81 bytes at most for the default model, so a body past that cannot hold a prompt that
fits) is checked against ``Content-Length`` before anything is read, and against the bytes
received for a chunked body, so a 20 MB body costs nothing: 413 in the OpenAI error shape.

The whole body must arrive within ``--body-timeout`` seconds (default 60; uvicorn bounds neither
its time nor that of the headers): a slower or endless one (chunks trickled forever under the
size cap) is answered 408 ``request_timeout`` and its connection closed. The headers' deadline,
and the one of a body the client goes on sending after an early answer, are the connection's
(``server.protocol``).

A client that disconnects while sending its body (or whose chunked body is malformed: the ASGI
server then reports a disconnect) is a client error: :class:`ClientGone`, logged as one access
line with status 499 and counted as 499 in ``/metrics``, never a traceback or a 500.
"""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from turnkv.config import parse_size
from turnkv.server.schemas import ApiError

BODY_MIN_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 128
CLIENT_CLOSED = 499  # nginx's "client closed request"


def body_limit(setting: str, max_context: int) -> int:
    """Bytes of ``--max-body-bytes``: a size, or ``auto`` (derived from the context length)."""
    if setting == "auto":
        return max(BODY_MIN_BYTES, BODY_BYTES_PER_TOKEN * max_context)
    return parse_size(setting)


class ClientGone(ApiError):
    """The client went away before its request was read (answered 499 to nobody)."""

    def __init__(self) -> None:
        super().__init__(
            CLIENT_CLOSED,
            "the client closed the connection while sending the request body",
            code="client_closed",
        )


def too_large(limit: int, size: str) -> ApiError:
    return ApiError(
        413,
        f"The request body ({size}) is larger than this server's limit of {limit} bytes "
        f"(--max-body-bytes). Shorten the prompt.",
        code="request_too_large",
    )


def too_slow(timeout: float) -> ApiError:
    return ApiError(
        408,
        f"The request body did not arrive within {timeout:g} s (--body-timeout).",
        code="request_timeout",
        headers={"Connection": "close"},  # the rest of the body may still be on its way
    )


async def read_body(request: Request, limit: int, timeout: float = 0.0) -> bytes:
    """The whole body, at most ``limit`` bytes, within ``timeout`` seconds (0: no limit); raises
    413 (too large), 408 (too slow), 400 or :class:`ClientGone`."""
    if timeout <= 0:
        return await _read(request, limit)
    try:
        return await asyncio.wait_for(_read(request, limit), timeout)
    except asyncio.TimeoutError:
        raise too_slow(timeout) from None


async def _read(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ApiError(400, f"invalid Content-Length {declared[:40]!r}")
        if int(declared) > limit:
            raise too_large(limit, f"{int(declared)} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit, f"more than {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)
