"""The OpenAI response bodies: a whole answer, or SSE chunks exactly as the OpenAI API sends them.

Chat chunks: the first carries ``delta.role``, then ``delta.content`` pieces, then one chunk with
``finish_reason`` and an empty delta; with ``stream_options.include_usage`` every chunk carries
``"usage": null`` and one last chunk with ``choices: []`` carries the usage; then ``data: [DONE]``.
Completion chunks carry ``text``. Every ``usage`` has ``prompt_tokens_details.cached_tokens``.

When the answer is read as tool calls (``tools``, a ``ToolPlan``), ``message.tool_calls`` holds them
(``id``, ``type``, ``function.name``, ``function.arguments`` as the JSON text the model wrote),
``content`` is null when the model wrote nothing else, and ``finish_reason`` is ``tool_calls``. A
stream sends, per call, one ``delta.tool_calls`` chunk with its ``index``, ``id``, ``type`` and
``function.name`` (``arguments: ""``), then chunks of ``function.arguments`` fragments, as the
OpenAI API does; the fragments join into the same arguments as the whole answer's.

``respond`` reads the turn's events from its ``TurnStream`` (``server.stream``) and counts the
answer in ``Metrics``; it never sees the server.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from turnkv.chat_format.toolcalls import CallArgs, CallStart, Content, Piece, ToolCallParser
from turnkv.engine.events import Admitted, Failed, GenEvent
from turnkv.server.logprobs import Collector, LogprobFormat
from turnkv.server.stream import TurnStream, failed_error

if TYPE_CHECKING:
    from turnkv.chat_format.structured import ToolPlan
    from turnkv.server.metrics import Metrics


ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/health",
    "/metrics",
)


def route_label(request: Request) -> str:
    """The metrics label of a request: one of our routes, ``/v1/models/{id}``, or ``other``
    (bounded cardinality)."""
    path = request.url.path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    return path if path in ROUTES else "other"


def note_usage(request: Request, admitted: Admitted, completion: int, finish: str | None) -> None:
    """What the access log prints for this request (``server.access``)."""
    request.state.usage = {
        "prompt": admitted.prompt_tokens,
        "cached": admitted.cached_tokens,
        "completion": completion,
        "finish": finish,
    }


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def finish_reason(finish: str | None, calls: int) -> str | None:
    """``tool_calls`` for an answer that ended at its end (not cut by length) with calls."""
    return "tool_calls" if calls and finish == "stop" else finish


def chat_message(text: str, tools: ToolPlan | None) -> dict:
    """The ``message`` of a whole chat answer (tool calls parsed when ``tools``)."""
    if tools is None:
        return {"role": "assistant", "content": text}
    parser = ToolCallParser(tools.fmt, tools.max_calls)
    parser.push(text)
    parser.finish()
    message: dict = {"role": "assistant", "content": parser.content or (None if parser.calls else "")}
    if parser.calls:
        message["tool_calls"] = [
            {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parser.calls
        ]
    return message


def delta_of(piece: Piece) -> dict:
    """One parsed piece of a streamed answer as a chat chunk's ``delta``."""
    if isinstance(piece, Content):
        return {"content": piece.text}
    if isinstance(piece, CallStart):
        fn = {"name": piece.name, "arguments": ""}
        return {"tool_calls": [{"index": piece.index, "id": call_id(), "type": "function", "function": fn}]}
    assert isinstance(piece, CallArgs)
    return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}


def _finished(metrics: Metrics, route: str, stats) -> None:
    metrics.request(route, 200)
    if stats is not None:
        metrics.turn(stats)


async def respond(
    stream: TurnStream,
    req,
    metrics: Metrics,
    model: str,
    fingerprint: str,
    chat: bool,
    tools: ToolPlan | None = None,
    logprobs: LogprobFormat | None = None,
) -> Response:
    """The response to ``req`` (a parsed body), answered by ``model`` (``system_fingerprint``:
    ``fingerprint``) from the turn of ``stream``: a whole body, or SSE chunks as it generates;
    ``logprobs`` writes the tokens' logprobs when the turn asked for them (``server.logprobs``)."""
    admitted = await stream.start()
    asked = logprobs is not None and stream.turn.logprobs is not None
    lps = Collector(logprobs, chat) if asked else None
    request = stream.request
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    base = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": fingerprint,
    }
    route = route_label(request)
    if req.stream:
        return StreamingResponse(
            _sse_events(stream, metrics, base, admitted, chat, req.include_usage(), route, tools, lps),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    text, final = await stream.whole(None if lps is None else lambda ev: lps.add(ev.logprob, ev.text))
    stats = final.stats
    _finished(metrics, route, stats)
    note_usage(request, admitted, stats.completion_tokens, final.finish_reason)
    usage = _usage(admitted.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
    if chat:
        message = chat_message(text, tools)
        choice = {
            "index": 0,
            "message": message,
            "logprobs": lps.whole() if lps is not None else None,
            "finish_reason": finish_reason(final.finish_reason, len(message.get("tool_calls", ()))),
        }
        body = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": lps.whole() if lps is not None else None,
            "finish_reason": final.finish_reason,
        }
        body = {**base, "choices": [choice], "usage": usage}
    return JSONResponse(body)


async def _sse_events(
    stream: TurnStream,
    metrics: Metrics,
    base: dict,
    admitted: Admitted,
    chat: bool,
    include_usage: bool,
    route: str,
    tools: ToolPlan | None = None,
    lps: Collector | None = None,
) -> AsyncIterator[str]:
    request = stream.request
    extra = {"usage": None} if include_usage else {}
    parser = ToolCallParser(tools.fmt, tools.max_calls) if tools is not None else None

    def chunk(
        content: str | None,
        finish: str | None,
        role: bool = False,
        delta: dict | None = None,
        lp: bool = False,
    ) -> dict:
        """One chunk; ``lp``: it carries the logprobs of the tokens not sent yet."""
        logprobs = lps.take() if lp and lps is not None else None
        if chat:
            delta = dict(delta or {})
            if role:
                delta["role"] = "assistant"
            if content is not None:
                delta["content"] = content
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": content or "", "logprobs": logprobs, "finish_reason": finish}
        return {**base, "choices": [choice], **extra}

    def pieces(text: str, last: bool) -> list[str]:
        """SSE lines of answer text: as is, or through the tool-call parser (the first brings the
        logprobs of the tokens whose text it holds)."""
        if parser is None:
            return [_sse(chunk(text, None, lp=True))] if text else []
        found = parser.push(text) + (parser.finish() if last else [])
        return [_sse(chunk(None, None, delta=delta_of(p), lp=i == 0)) for i, p in enumerate(found)]

    tokens = 0
    try:
        if chat:
            yield _sse(chunk("", None, role=True))
        async for ev in stream:  # ends at the answer's last event
            if isinstance(ev, Failed):
                err = failed_error(ev)
                metrics.request(route, err.status)
                yield _sse(err.body())
                break
            if not isinstance(ev, GenEvent):
                continue
            tokens += ev.token_id is not None
            if lps is not None:
                lps.add(ev.logprob, ev.text)
            for line in pieces(ev.text, last=ev.finish_reason is not None):
                yield line
            if ev.finish_reason is None:
                continue
            finish = finish_reason(ev.finish_reason, len(parser.calls) if parser is not None else 0)
            yield _sse(chunk(None if chat else "", finish, lp=True))  # the entries still held
            stats = ev.stats
            _finished(metrics, route, stats)
            note_usage(request, admitted, stats.completion_tokens, ev.finish_reason)
            if include_usage:
                usage = _usage(admitted.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
                yield _sse({**base, "choices": [], "usage": usage})
            break
        yield _sse("[DONE]")
    finally:
        # the client went away (the response task was cancelled) or we are done: either way the
        # worker must stop generating for nobody; it still banks what it computed
        stream.cancel()
        if getattr(request.state, "usage", None) is None:
            note_usage(request, admitted, tokens, "cancelled")
