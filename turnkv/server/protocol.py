"""uvicorn's h11 protocol with the deadlines it lacks: a request's headers, and a body nobody reads.

uvicorn closes a keep-alive connection that stays idle ``timeout_keep_alive`` seconds after an
answer, and h11 caps the headers' size (``MAX_HEADER_BYTES``, then 400), but nothing bounds their time: a
connection that sends nothing, or its headers a byte at a time (slowloris), is held forever. Here
the headers must be complete within ``--header-timeout`` seconds of the connection opening (or of
the first byte of a later request on it); past it a client that sent part of them gets 408 in the
OpenAI shape, one that sent nothing is just closed. A body is the app's to bound
(``server.body``), except one the client goes on sending after it was answered (a 401, 413 or 415
is sent before the body is read, and uvicorn reads on and drops it, for ever if it is endless):
that connection is closed ``--body-timeout`` seconds after the answer. A request h11 cannot parse
(malformed, or headers past ``MAX_HEADER_BYTES``) gets uvicorn's 400, here in the OpenAI shape.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from turnkv.server.schemas import ApiError


def _answer(error: ApiError, phrase: str) -> bytes:
    """A whole HTTP/1.1 answer closing the connection, written before (or instead of) h11's."""
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {error.status} {phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _timeout_answer(timeout: float) -> bytes:
    message = f"The request headers did not arrive within {timeout:g} s (--header-timeout)."
    return _answer(ApiError(408, message, code="request_timeout"), "Request Timeout")


MAX_HEADER_BYTES = 16 * 1024  # h11's default, stated: a request line and headers larger get 400
BAD_REQUEST = _answer(
    ApiError(
        400,
        f"Invalid HTTP request: malformed, or a request line and headers over {MAX_HEADER_BYTES // 1024} KiB.",
        code="invalid_http_request",
    ),
    "Bad Request",
)


ANSWERED = (h11.DONE, h11.MUST_CLOSE)  # our states once an answer has been sent


class DeadlineH11(H11Protocol):
    """H11Protocol with one timer per connection, for one ``phase``: ``headers`` (a request's are
    due) or ``drain`` (an answered request's body is still coming)."""

    header_timeout = 10.0
    body_timeout = 60.0

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.deadline: asyncio.TimerHandle | None = None
        self.phase: str | None = None

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        if seconds > 0:
            self.phase = phase
            self.deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = self.phase = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers", self.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self.phase != "headers":  # a new request's first byte
            self._arm("headers", self.header_timeout)
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE and self.phase != "headers":  # a drained body ended: the next request is due
            self._arm("headers", self.header_timeout)
        elif state is not h11.IDLE and self.phase == "headers":
            self._disarm()  # the headers are in: the app has the request (and its body's deadline)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and self.conn.our_state in ANSWERED:
            self._arm("drain", self.body_timeout)  # answered before its body was read
        elif self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:  # part of a pipelined request
            self._arm("headers", self.header_timeout)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what h11 cannot parse, in the OpenAI error shape (not plain text)."""
        self.transport.write(BAD_REQUEST)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _expired(self) -> None:
        phase = self.phase
        self.deadline = self.phase = None
        if self.transport.is_closing():
            return
        if phase == "headers" and self.conn.their_state is h11.IDLE:
            if self.conn.trailing_data[0]:  # part of a request came: say why it ends
                self.transport.write(_timeout_answer(self.header_timeout))
            self.transport.close()
        elif phase == "drain" and self.conn.their_state is h11.SEND_BODY and self.conn.our_state in ANSWERED:
            self.transport.close()


def deadline_protocol(header_timeout: float, body_timeout: float) -> type[DeadlineH11]:
    """The protocol class for uvicorn's ``http=`` with these deadlines (seconds; 0: none)."""
    return type(
        "DeadlineH11", (DeadlineH11,), {"header_timeout": header_timeout, "body_timeout": body_timeout}
    )
