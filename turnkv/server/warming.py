"""The HTTP face of start-up: what the socket answers before the engine is warm.

``turnkv serve`` listens as soon as the socket is bound; a ``WarmGate`` is the ASGI app uvicorn
serves. Until ``open(app)`` it answers ``GET /health`` with 503 and ``"status": "warming"`` (or
``"loading"``, then ``"failed"`` with the error) and the start-up's progress (phase, turns
done/total), and every other route with 503 and ``Retry-After`` in its API's error shape
(Anthropic's under ``/v1/messages``, OpenAI's elsewhere). After ``open`` every request goes to the
app, unchanged. The gate owns the lifespan: on shutdown it runs ``on_shutdown`` (the app's
``shutdown``), which the app's own lifespan would have run.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from turnkv.engine.warmup import WarmProgress
from turnkv.server.messages_stream import anthropic_body
from turnkv.server.schemas import ApiError

RETRY_AFTER_S = 5  # what a 503 during start-up tells a client


def warming_health(progress: WarmProgress, model: str) -> dict:
    """The ``/health`` document before ready (status ``loading``, ``warming`` or ``failed``)."""
    return {"status": progress.state, "model": model, "warmup": progress.doc()}


def refusal(path: str, progress: WarmProgress) -> dict:
    """The 503 body of ``path`` before ready, in its API's shape."""
    what = f"the server is {progress.state} ({progress.phase}: {progress.done}/{progress.total})"
    msg = f"{what}; retry in {RETRY_AFTER_S} s (GET /health says ok when it is ready)"
    error = ApiError(503, msg, "server_error", code="warming_up")
    return anthropic_body(error) if path.startswith("/v1/messages") else error.body()


class WarmGate:
    """The ASGI app of a starting server (module docstring)."""

    def __init__(self, progress: WarmProgress, model: str) -> None:
        self.progress = progress
        self.model = model
        self.app = None  # the real app, once ``open`` ran
        self.on_shutdown: Callable[[], Awaitable[None]] | None = None

    def open(self, app, on_shutdown: Callable[[], Awaitable[None]] | None = None) -> None:
        self.on_shutdown = on_shutdown
        self.progress.state = "ok"
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":  # websockets: none served
            return
        path = scope.get("path", "")
        if path == "/health":
            body, headers = warming_health(self.progress, self.model), []
        else:
            body, headers = refusal(path, self.progress), [(b"retry-after", str(RETRY_AFTER_S).encode())]
        data = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                    *headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self.on_shutdown is not None:
                    await self.on_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return
