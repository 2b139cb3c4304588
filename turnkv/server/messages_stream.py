"""Anthropic Messages answers from a turn's ``TurnStream``: a whole ``message`` body, or its SSE
events exactly as the Anthropic API sends them (``event:`` line, then ``data:``).

A stream is ``message_start`` (the message with empty ``content`` and the prompt's usage),
``ping``, then per content block ``content_block_start`` / ``content_block_delta``\\* /
``content_block_stop`` (a text block takes ``text_delta`` pieces; a ``tool_use`` block starts with
``input: {}`` and takes ``input_json_delta`` pieces of its arguments' JSON text), then
``message_delta`` (``stop_reason``, ``stop_sequence``, the final usage) and ``message_stop``. A turn
that fails after the stream began sends one ``error`` event in the Anthropic error shape.

The answer is read as tool calls (``ToolCallParser``) when the request has tools, as on the chat
route; a call is a ``tool_use`` block with its arguments as the ``input`` object. ``stop_reason``:
``tool_use`` (an answer with calls that ended by itself), ``end_turn`` (the end-of-turn token),
``stop_sequence`` (one of ``stop_sequences``, named in ``stop_sequence``), ``max_tokens``, and
``pause_turn`` for an answer the server cancelled (shutting down): sent back as is, it continues.

``usage``: ``input_tokens`` are the prompt tokens this turn computed, ``cache_read_input_tokens``
those served from the bank or disk (the two add up to the prompt), ``cache_creation_input_tokens``
is always 0: every turn is banked, there is nothing extra to pay for writing it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response, StreamingResponse

from turnkv.bank.breaks import CacheBreak
from turnkv.chat_format.toolcalls import CallArgs, CallStart, Content, Piece, ToolCallParser, call_input
from turnkv.engine.events import Admitted, Failed, GenEvent
from turnkv.server.responses import break_body, note_usage, route_label
from turnkv.server.stream import TurnStream, failed_error

if TYPE_CHECKING:
    from turnkv.chat_format.structured import ToolPlan
    from turnkv.server.metrics import Metrics
    from turnkv.server.schemas import ApiError

STOP_REASONS = {"length": "max_tokens", "cancelled": "pause_turn"}


def anthropic_body(error: ApiError) -> dict:
    """An error in the Anthropic shape: the type by status, a 507's byte counts kept."""
    kind = ERROR_TYPES.get(error.status) or ("invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message, **error.extra}}


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def stop_reason(ev: GenEvent, calls: int) -> str:
    if ev.finish_reason == "stop":
        return "tool_use" if calls else "stop_sequence" if ev.stop_sequence is not None else "end_turn"
    return STOP_REASONS.get(ev.finish_reason or "", "end_turn")


def usage(prompt: int, cached: int, output: int, brk: CacheBreak | None = None) -> dict:
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
        "cache_break": break_body(brk),
    }


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _count(metrics: Metrics, route: str, ev: GenEvent) -> None:
    metrics.request(route, 200)
    if ev.stats is not None:
        metrics.turn(ev.stats)


async def answer(
    stream: TurnStream, streaming: bool, metrics: Metrics, model: str, tools: ToolPlan | None
) -> Response:
    """The Messages answer of the turn of ``stream`` (``tools``: the answer is read as calls)."""
    admitted = await stream.start()
    head = {"id": message_id(), "type": "message", "role": "assistant", "model": model}
    if streaming:
        return StreamingResponse(
            _events(stream, metrics, head, admitted, tools),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    text, final = await stream.whole()
    stats = final.stats
    assert stats is not None
    _count(metrics, route_label(stream.request), final)
    note_usage(stream.request, admitted, stats.completion_tokens, final.finish_reason)
    content: list[dict] = []
    calls = 0
    if tools is None:
        content = [{"type": "text", "text": text}] if text else []
    else:
        parser = ToolCallParser(tools.fmt, tools.max_calls)
        parser.push(text)
        parser.finish()
        content = [{"type": "text", "text": parser.content}] if parser.content else []
        for c in parser.calls:
            content.append(
                {"type": "tool_use", "id": tool_use_id(), "name": c.name, "input": call_input(c.arguments)}
            )
        calls = len(parser.calls)
    body = {
        **head,
        "content": content,
        "stop_reason": stop_reason(final, calls),
        "stop_sequence": final.stop_sequence,
        "usage": usage(
            admitted.prompt_tokens, stats.cached_tokens, stats.completion_tokens, admitted.cache_break
        ),
    }
    return JSONResponse(body)


class _Blocks:
    """The content blocks of a streamed answer: which is open, and the events that move them."""

    def __init__(self) -> None:
        self.count = 0  # blocks started
        self.open: str | None = None  # the type of the open block (the last started)

    def start(self, block: dict) -> list[str]:
        out = self.stop()
        out.append(
            _sse(
                "content_block_start",
                {"type": "content_block_start", "index": self.count, "content_block": block},
            )
        )
        self.count += 1
        self.open = block["type"]
        return out

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": self.count - 1})]

    def delta(self, delta: dict) -> str:
        return _sse(
            "content_block_delta", {"type": "content_block_delta", "index": self.count - 1, "delta": delta}
        )

    def piece(self, piece: Piece) -> list[str]:
        """The events of one parsed piece of the answer."""
        if isinstance(piece, Content):
            if not piece.text:
                return []
            out = [] if self.open == "text" else self.start({"type": "text", "text": ""})
            return [*out, self.delta({"type": "text_delta", "text": piece.text})]
        if isinstance(piece, CallStart):
            return self.start({"type": "tool_use", "id": tool_use_id(), "name": piece.name, "input": {}})
        assert isinstance(piece, CallArgs)
        return [self.delta({"type": "input_json_delta", "partial_json": piece.text})] if piece.text else []


async def _events(
    stream: TurnStream, metrics: Metrics, head: dict, admitted: Admitted, tools: ToolPlan | None
) -> AsyncIterator[str]:
    request = stream.request
    prompt, cached = admitted.prompt_tokens, admitted.cached_tokens
    route = route_label(request)
    parser = ToolCallParser(tools.fmt, tools.max_calls) if tools is not None else None
    blocks = _Blocks()
    tokens = 0
    start = {
        **head,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(prompt, cached, 0, admitted.cache_break),
    }
    try:
        yield _sse("message_start", {"type": "message_start", "message": start})
        yield _sse("ping", {"type": "ping"})
        async for ev in stream:  # ends at the answer's last event
            if isinstance(ev, Failed):
                err = failed_error(ev)
                metrics.request(route, err.status)
                yield _sse("error", anthropic_body(err))
                break
            if not isinstance(ev, GenEvent):
                continue
            tokens += ev.token_id is not None
            last = ev.finish_reason is not None
            found = (
                [Content(ev.text)]
                if parser is None
                else parser.push(ev.text) + (parser.finish() if last else [])
            )
            for piece in found:
                for line in blocks.piece(piece):
                    yield line
            if not last:
                continue
            for line in blocks.stop():
                yield line
            stats = ev.stats
            assert stats is not None
            _count(metrics, route, ev)
            note_usage(request, admitted, stats.completion_tokens, ev.finish_reason)
            delta = {
                "stop_reason": stop_reason(ev, len(parser.calls) if parser else 0),
                "stop_sequence": ev.stop_sequence,
            }
            final = usage(prompt, stats.cached_tokens, stats.completion_tokens, admitted.cache_break)
            yield _sse("message_delta", {"type": "message_delta", "delta": delta, "usage": final})
            yield _sse("message_stop", {"type": "message_stop"})
            break
    finally:
        # the client went away or we are done: the worker stops generating for nobody (it banks
        # what it computed)
        stream.cancel()
        if getattr(request.state, "usage", None) is None:
            note_usage(request, admitted, tokens, "cancelled")
