"""The event stream of one turn, from the engine thread into a handler's event loop.

``TurnStream.start`` submits the turn to the engine worker and waits for its first event: the
``Admitted`` it returns, or a refusal it raises as the ``ApiError`` of its code
(``failed_error``). Iterating the stream then yields the turn's events up to its last answer
event (a ``Failed``, or the ``GenEvent`` with a ``finish_reason`` of its last choice to end:
``TurnRequest.n`` choices, each event naming its ``choice``). A client that goes away while
the handler waits sets the turn's cancel flag; the worker still seals and banks what it computed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import Request

from turnkv.engine.events import Admitted, Failed, GenEvent, TurnRequest
from turnkv.server.loop_post import LoopPost
from turnkv.server.schemas import ApiError

# what a turn's failure code answers with
STATUS = {
    "invalid_request_error": 400,
    "context_length_exceeded": 400,
    "kv_memory_exhausted": 507,
    "cancelled": 499,
    "queue_timeout": 503,
    "tensor_parallel_down": 503,  # a rank of the group died: restart the server
    "internal_error": 500,
}

RETRY_AFTER_S = 5  # what a 503 (a turn that waited past --queue-timeout) tells the client

Emit = Callable[[object], None]
Submit = Callable[[TurnRequest, Emit], None]  # ``EngineWorker.submit``


def failed_error(f: Failed) -> ApiError:
    """The HTTP error of a turn's ``Failed`` event."""
    status = STATUS.get(f.code, 500)
    if status == 507:
        return ApiError(
            507,
            f.message,
            "server_error",
            code=f.code,
            needed_bytes=f.needed_bytes,
            available_bytes=f.available_bytes,
        )
    type_ = "invalid_request_error" if status < 500 else "server_error"
    code = None if f.code == "invalid_request_error" else f.code
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return ApiError(status, f.message, type_, code=code, headers=headers)


class TurnStream:
    """The events of ``turn``, submitted through ``submit``, for the handler of ``request``; the
    engine thread's emits reach this loop through ``post`` (flushed by the worker each step)."""

    def __init__(self, submit: Submit, turn: TurnRequest, request: Request, post: LoopPost) -> None:
        self.turn = turn
        self._post = post
        self.request = request
        self._submit = submit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._ended = False  # the last answer event was yielded
        self._open = turn.n  # choices whose answer has not ended yet

    async def start(self) -> Admitted:
        """Queue the turn and wait until it is admitted; a refusal or a 400 raises ApiError."""
        self._loop = asyncio.get_running_loop()
        self._submit(self.turn, self._emit)
        first = await self._next()
        if isinstance(first, Failed):
            raise failed_error(first)
        assert isinstance(first, Admitted), first
        return first

    def cancel(self) -> None:
        """Stop the turn at its next token (it still banks what it computed)."""
        self.turn.cancel.set()

    def __aiter__(self) -> TurnStream:
        return self

    async def __anext__(self) -> object:
        if self._ended:
            raise StopAsyncIteration
        ev = await self._next()
        if isinstance(ev, GenEvent) and ev.finish_reason is not None:
            self._open -= 1
        self._ended = isinstance(ev, Failed) or self._open == 0
        return ev

    async def answers(self, each: Callable[[GenEvent], None] | None = None) -> list[tuple[str, GenEvent]]:
        """Each choice's text and last event, by choice (``each`` sees every answer event); a turn
        that fails (any choice) raises its ``ApiError``."""
        pieces: list[list[str]] = [[] for _ in range(self.turn.n)]
        finals: list[GenEvent | None] = [None] * self.turn.n
        async for ev in self:  # ends at the last choice's last event
            if isinstance(ev, Failed):
                raise failed_error(ev)
            if isinstance(ev, GenEvent):
                pieces[ev.choice].append(ev.text)
                if each is not None:
                    each(ev)
                finals[ev.choice] = ev
        assert all(f is not None and f.stats is not None for f in finals)
        return [("".join(p), f) for p, f in zip(pieces, finals, strict=True)]  # type: ignore[misc]

    async def whole(self, each: Callable[[GenEvent], None] | None = None) -> tuple[str, GenEvent]:
        """The answer's text and its last event, of a turn of one choice (``answers``)."""
        return (await self.answers(each))[0]

    def _emit(self, item: object) -> None:  # called on the worker thread
        assert self._loop is not None
        self._post.post(self._loop, self._queue.put_nowait, item)

    async def _next(self) -> object:
        """The next worker event; cancels the turn if the client disconnects while we wait."""
        get = asyncio.ensure_future(self._queue.get())
        gone = asyncio.ensure_future(_disconnected(self.request))
        try:
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.cancel()
            get.cancel()
            raise
        finally:
            gone.cancel()
        if get in done:
            return get.result()
        self.cancel()
        return await get


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the ASGI server sends ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
