"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

The body (``server.messages_schema``) is adapted to the OpenAI-shaped messages the chat template
renders, and then goes the way of a chat completion: the same key and content-type checks, the
same rendering (``Prompts.chat``), tool plan and grammars (``chat_format.structured``), turn, bank
and scheduler (``Server.open_turn``); only the answer's wire format differs
(``server.messages_stream``). ``x-api-key`` is accepted as the key beside a bearer token, and
``anthropic-version`` / ``anthropic-beta`` headers are accepted and need not be sent.

Every error of these routes, from the header checks to a turn refused for KV memory, is in
Anthropic's shape ``{"type": "error", "error": {"type", "message"}}`` with the status it has on
the OpenAI routes (400, 401, 404, 408, 413, 415, 503, 507 with ``needed_bytes`` and
``available_bytes``); the ``type`` follows the status (``messages_stream.ERROR_TYPES``).

The routes are left out of ``/openapi.json``, which describes the OpenAI shape (its error bodies
included); docs/SERVER.md documents them.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from turnkv.chat_format.grammar import Grammars
from turnkv.chat_format.structured import (
    ChatFormatError,
    Structure,
    chat_structure,
    check_arguments,
    check_tools,
)
from turnkv.server.messages_schema import (
    Conversation,
    CountTokensRequest,
    MessagesRequest,
    ToolUseBlock,
)
from turnkv.server.messages_stream import answer, anthropic_body
from turnkv.server.schemas import ApiError, bad_request


class AnthropicError(ApiError):
    """An ``ApiError`` answered in Anthropic's shape (the app's handler writes ``body()``)."""

    def __init__(self, e: ApiError) -> None:
        super().__init__(e.status, e.message, e.type, e.code, e.param, e.headers, **e.extra)

    def body(self) -> dict:
        return anthropic_body(self)


def conversation_structure(count_only: bool):
    """``Server.prepare``'s structure of a ``Conversation``; ``count_only``: the prompt alone (the
    tool choice does not change what is rendered, so no grammar is compiled)."""

    def structure(conv: Conversation, grammars: Grammars, template: str | None) -> Structure:
        try:
            tools, choice = conv.raw_tools(), None if count_only else conv.tool_choice()
            check_tools(tools, choice)
            for i, m in enumerate(conv.body.messages):
                for j, b in enumerate(m.content):
                    if isinstance(b, ToolUseBlock):
                        check_arguments(b.input, f"messages[{i}].content[{j}].input")
            st = chat_structure(grammars, template, None, tools, choice, conv.parallel())
        except ChatFormatError as e:
            param = e.param.replace(".function.parameters", ".input_schema")
            raise bad_request(e.message.replace(e.param, param), param=param) from None
        # a call comes back as its ``input`` object (a cut one as its partial parse)
        return replace(st, plan=replace(st.plan, calls_as_input=True)) if st.plan else st

    return structure


def register_messages(app: FastAPI, srv) -> None:
    """Add the Messages routes to ``app`` for ``srv`` (a ``server.app.Server``)."""
    strip = srv.cfg.strip_billing_header

    async def _messages(request: Request) -> Response:
        body = await srv.read_request(request, MessagesRequest)
        conv = Conversation(body, strip)
        stream, st = await srv.open_turn(request, conv, True, conversation_structure(False))
        return await answer(stream, body.stream, srv.metrics, srv.engine.info.model_name, st.plan)

    async def _count_tokens(request: Request) -> JSONResponse:
        body = await srv.read_request(request, CountTokensRequest)
        conv = Conversation(body, strip)
        ids, _, _ = await asyncio.to_thread(srv.prepare, conv, True, conversation_structure(True))
        srv.metrics.request("/v1/messages/count_tokens", 200)
        return JSONResponse({"input_tokens": len(ids)})

    for path, handler in (("/v1/messages", _messages), ("/v1/messages/count_tokens", _count_tokens)):
        app.add_api_route(path, anthropic_errors(handler), methods=["POST"], include_in_schema=False)


def anthropic_errors(handler):
    """``handler`` with every ``ApiError`` it raises answered in Anthropic's shape."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except AnthropicError:
            raise
        except ApiError as e:
            raise AnthropicError(e) from None

    route.__name__ = handler.__name__
    return route
