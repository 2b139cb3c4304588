"""The OpenAI response bodies: a whole answer, or SSE chunks exactly as the OpenAI API sends them.

Chat chunks: the first carries ``delta.role``, then ``delta.content`` pieces, then one chunk with
``finish_reason`` and an empty delta; with ``stream_options.include_usage`` every chunk carries
``"usage": null`` and one last chunk with ``choices: []`` carries the usage; then ``data: [DONE]``.
Completion chunks carry ``text``. Every ``usage`` has ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from turnkv.engine.turn import Admitted, Failed, GenEvent, TurnRequest
from turnkv.server.schemas import ApiError

if TYPE_CHECKING:
    from turnkv.server.app import Server, _Stream


ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


def route_label(request: Request) -> str:
    """The metrics label of a request: one of our routes, ``/v1/models/{id}``, or ``other``
    (bounded cardinality)."""
    path = request.url.path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return path if path in ROUTES else "other"


def note_usage(request: Request, admitted: Admitted, completion: int, finish: str | None) -> None:
    """What the access log prints for this request (``server.access``)."""
    request.state.usage = {
        "prompt": admitted.prompt_tokens,
        "cached": admitted.cached_tokens,
        "completion": completion,
        "finish": finish,
    }


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


def failed_error(f: Failed) -> ApiError:
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


async def respond(srv: Server, request: Request, turn: TurnRequest, req, chat: bool) -> Response:
    stream, admitted = await srv.start(turn, request)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    base = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": srv.engine.info.model_name,
        "system_fingerprint": srv.engine.info.fingerprint,
    }
    route = route_label(request)
    if req.stream:
        return StreamingResponse(
            _sse_events(srv, stream, turn, request, base, admitted, chat, req.include_usage(), route),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    pieces: list[str] = []
    while True:
        ev = await srv._next(stream, turn, request)
        if isinstance(ev, Failed):
            raise failed_error(ev)
        if isinstance(ev, GenEvent):
            pieces.append(ev.text)
            if ev.finish_reason is not None:
                final = ev
                break
    text = "".join(pieces)
    stats = final.stats
    srv.finished(route, stats)
    note_usage(request, admitted, stats.completion_tokens, final.finish_reason)
    usage = _usage(admitted.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": final.finish_reason,
        }
        body = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": final.finish_reason}
        body = {**base, "choices": [choice], "usage": usage}
    return JSONResponse(body)


async def _sse_events(
    srv: Server,
    stream: _Stream,
    turn: TurnRequest,
    request: Request,
    base: dict,
    admitted: Admitted,
    chat: bool,
    include_usage: bool,
    route: str,
) -> AsyncIterator[str]:
    extra = {"usage": None} if include_usage else {}

    def chunk(content: str | None, finish: str | None, role: bool = False) -> dict:
        if chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if content is not None:
                delta["content"] = content
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
        return {**base, "choices": [choice], **extra}

    tokens = 0
    try:
        if chat:
            yield _sse(chunk("", None, role=True))
        while True:
            ev = await srv._next(stream, turn, request)
            if isinstance(ev, Failed):
                err = failed_error(ev)
                srv.metrics.request(route, err.status)
                yield _sse(err.body())
                break
            if not isinstance(ev, GenEvent):
                continue
            tokens += ev.token_id is not None
            if ev.finish_reason is None:
                if ev.text:
                    yield _sse(chunk(ev.text, None))
                continue
            if ev.text:
                yield _sse(chunk(ev.text, None))
            yield _sse(chunk(None if chat else "", ev.finish_reason))
            stats = ev.stats
            srv.finished(route, stats)
            note_usage(request, admitted, stats.completion_tokens, ev.finish_reason)
            if include_usage:
                usage = _usage(admitted.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
                yield _sse({**base, "choices": [], "usage": usage})
            break
        yield _sse("[DONE]")
    finally:
        # the client went away (the response task was cancelled) or we are done: either way the
        # worker must stop generating for nobody; it still banks what it computed
        turn.cancel.set()
        if getattr(request.state, "usage", None) is None:
            note_usage(request, admitted, tokens, "cancelled")
