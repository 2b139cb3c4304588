"""The OpenAI response bodies: a whole answer, or SSE chunks exactly as the OpenAI API sends them.

Chat chunks: the first carries ``delta.role``, then ``delta.content`` pieces, then one chunk with
``finish_reason`` and an empty delta; with ``stream_options.include_usage`` every chunk carries
``"usage": null`` and one last chunk with ``choices: []`` carries the usage; then ``data: [DONE]``.
Completion chunks carry ``text``. Every ``usage`` has ``prompt_tokens_details.cached_tokens`` and
the ``cache_break`` extension (``break_body``).

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

from turnkv.bank.breaks import CacheBreak
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
    "/tokenize",
    "/detokenize",
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


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, brk: CacheBreak | None) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "cache_break": break_body(brk),
    }


def break_body(brk: CacheBreak | None) -> dict | None:
    """``usage.cache_break`` of every API: where the reused prefix ended and why (``bank.breaks``)."""
    return brk.body() if brk is not None else None


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


def _finished(metrics: Metrics, route: str, stats: list) -> None:
    """A 200 answered; each choice's turn counted."""
    metrics.request(route, 200)
    for st in stats:
        if st is not None:
            metrics.turn(st)


class _Choice:
    """One choice's answer as it streams: its tool-call parser and logprobs."""

    def __init__(self, tools: ToolPlan | None, lps: Collector | None) -> None:
        self.parser = ToolCallParser(tools.fmt, tools.max_calls) if tools is not None else None
        self.lps = lps
        self.tokens = 0

    def calls(self) -> int:
        return len(self.parser.calls) if self.parser is not None else 0


async def respond(
    stream: TurnStream,
    req,
    metrics: Metrics,
    model: str,
    fingerprint: str,
    chat: bool,
    tools: ToolPlan | None = None,
    logprobs: LogprobFormat | None = None,
    echo: str = "",
) -> Response:
    """The response to ``req`` (a parsed body), answered by ``model`` (``system_fingerprint``:
    ``fingerprint``) from the turn of ``stream``: a whole body, or SSE chunks as it generates;
    ``logprobs`` writes the tokens' logprobs when the turn asked for them (``server.logprobs``).
    ``choices`` has one entry per choice (``n``); ``usage`` counts the prompt once and the
    completion tokens of every choice. ``echo`` (completions): text before each choice's (streamed
    as each choice's first chunk; with logprobs, that chunk carries the prompt's, and comes when
    the prompt is computed)."""
    admitted = await stream.start()
    asked = logprobs is not None and stream.turn.logprobs is not None
    n = stream.turn.n
    choices = [_Choice(tools, Collector(logprobs, chat) if asked else None) for _ in range(n)]
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
            _sse_events(stream, metrics, base, admitted, chat, req.include_usage(), route, choices, echo),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def each(ev: GenEvent) -> None:
        lps = choices[ev.choice].lps
        if lps is not None:
            if ev.prompt_logprobs is not None:  # echo, scored: the prompt's entries first
                lps.prompt(stream.turn.prompt[0], ev.prompt_logprobs, echo)
            lps.add(ev.logprob, ev.text)

    answers = await stream.answers(each)
    finals = [final for _, final in answers]
    _finished(metrics, route, [f.stats for f in finals])
    completion = sum(f.stats.completion_tokens for f in finals)
    note_usage(request, admitted, completion, finals[0].finish_reason)
    usage = _usage(admitted.prompt_tokens, completion, finals[0].stats.cached_tokens, admitted.cache_break)
    out = []
    for i, ((text, final), c) in enumerate(zip(answers, choices, strict=True)):
        lp = c.lps.whole() if c.lps is not None else None
        if chat:
            message = chat_message(text, tools)
            calls = len(message.get("tool_calls", ()))
            fin = finish_reason(final.finish_reason, calls)
            out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": fin})
        else:
            out.append(
                {"index": i, "text": echo + text, "logprobs": lp, "finish_reason": final.finish_reason}
            )
    body = {**base, "choices": out, "usage": usage}
    if chat:
        body["object"] = "chat.completion"
    return JSONResponse(body)


async def _sse_events(
    stream: TurnStream,
    metrics: Metrics,
    base: dict,
    admitted: Admitted,
    chat: bool,
    include_usage: bool,
    route: str,
    choices: list[_Choice],
    echo: str = "",
) -> AsyncIterator[str]:
    request = stream.request
    extra = {"usage": None} if include_usage else {}

    def chunk(
        i: int,
        content: str | None,
        finish: str | None,
        role: bool = False,
        delta: dict | None = None,
        lp: bool = False,
    ) -> dict:
        """One chunk of choice ``i``; ``lp``: it carries the logprobs of the tokens not sent yet."""
        lps = choices[i].lps
        logprobs = lps.take() if lp and lps is not None else None
        if chat:
            delta = dict(delta or {})
            if role:
                delta["role"] = "assistant"
            if content is not None:
                delta["content"] = content
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": i, "text": content or "", "logprobs": logprobs, "finish_reason": finish}
        return {**base, "choices": [choice], **extra}

    def pieces(i: int, text: str, last: bool) -> list[str]:
        """SSE lines of answer text: as is, or through the tool-call parser (the first brings the
        logprobs of the tokens whose text it holds)."""
        parser = choices[i].parser
        if parser is None:
            return [_sse(chunk(i, text, None, lp=True))] if text else []
        found = parser.push(text) + (parser.finish() if last else [])
        return [_sse(chunk(i, None, None, delta=delta_of(p), lp=j == 0)) for j, p in enumerate(found)]

    finals: list[GenEvent] = []
    try:
        # a scored echo waits for its choice's first event, which brings the prompt's logprobs
        scored = stream.turn.prompt_logprobs is not None
        for i in range(len(choices) if chat or (echo and not scored) else 0):
            yield _sse(chunk(i, "" if chat else echo, None, role=chat))
        async for ev in stream:  # ends at the last choice's last event
            if isinstance(ev, Failed):
                err = failed_error(ev)
                metrics.request(route, err.status)
                yield _sse(err.body())
                break
            if not isinstance(ev, GenEvent):
                continue
            i, c = ev.choice, choices[ev.choice]
            c.tokens += ev.token_id is not None
            if c.lps is not None and ev.prompt_logprobs is not None:  # the echo and its logprobs
                c.lps.prompt(stream.turn.prompt[0], ev.prompt_logprobs, echo)
                yield _sse(chunk(i, echo, None, lp=True))
            if c.lps is not None:
                c.lps.add(ev.logprob, ev.text)
            for line in pieces(i, ev.text, last=ev.finish_reason is not None):
                yield line
            if ev.finish_reason is None:
                continue
            finish = finish_reason(ev.finish_reason, c.calls())
            yield _sse(chunk(i, None if chat else "", finish, lp=True))  # the entries still held
            finals.append(ev)
            if len(finals) < len(choices):
                continue
            finals.sort(key=lambda f: f.choice)
            _finished(metrics, route, [f.stats for f in finals])
            completion = sum(f.stats.completion_tokens for f in finals)
            note_usage(request, admitted, completion, finals[0].finish_reason)
            if include_usage:
                usage = _usage(
                    admitted.prompt_tokens, completion, finals[0].stats.cached_tokens, admitted.cache_break
                )
                yield _sse({**base, "choices": [], "usage": usage})
            break
        yield _sse("[DONE]")
    finally:
        # the client went away (the response task was cancelled) or we are done: either way the
        # worker must stop generating for nobody; it still banks what it computed
        stream.cancel()
        if getattr(request.state, "usage", None) is None:
            note_usage(request, admitted, sum(c.tokens for c in choices), "cancelled")
