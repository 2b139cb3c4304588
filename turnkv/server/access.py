"""The access log: one line per HTTP request, written when its response has been sent.

    127.0.0.1:51234 "POST /v1/chat/completions" 200 prompt=495 cached=494 completion=16 finish=length 1.234s

Fields: client, method and path, status, then for completion routes the prompt, cached and
completion tokens and the finish reason (set by the handlers in ``request.state.usage``), and the
wall time from the first byte of the request to the last byte of the response (a stream's whole
length). Logger ``turnkv.access`` at INFO; ``turnkv serve --no-access-log`` turns it off.
"""

from __future__ import annotations

import logging
import sys
import time

ACCESS_LOGGER = "turnkv.access"
USAGE_KEYS = ("prompt", "cached", "completion", "finish")


def access_logger() -> logging.Logger:
    """``turnkv.access``, writing bare lines to stderr at INFO (its handler is added once)."""
    log = logging.getLogger(ACCESS_LOGGER)
    log.propagate = False
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    return log


class AccessLog:
    """Pure ASGI middleware (it sees a streamed response end, which ``BaseHTTPMiddleware`` hides);
    ``enabled`` False passes every request through untouched (``--no-access-log``)."""

    def __init__(self, app, enabled: bool = True) -> None:
        self.app = app
        self.enabled = enabled
        self.log = access_logger() if enabled else logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.enabled:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 0

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            status = status or 500  # what the server answers for an exception that escaped the app
            raise
        finally:
            self.log.info(self.line(scope, status, time.perf_counter() - t0))

    @staticmethod
    def line(scope, status: int, seconds: float) -> str:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        path = "".join(c if c.isprintable() else repr(c)[1:-1] for c in scope.get("path", "")[:200])
        parts = [f'{who} "{scope.get("method", "")} {path}"', str(status or "-")]
        usage = (scope.get("state") or {}).get("usage") or {}
        parts += [f"{k}={usage[k]}" for k in USAGE_KEYS if k in usage]
        parts.append(f"{seconds:.3f}s")
        return " ".join(parts)
