"""The OpenAI Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A response runs as one chat turn (``TurnRequest``), its input items rendered by the chat template
(``responses_schema.to_messages``). With ``previous_response_id`` the prompt is that response's
token chain (``bank.response_store``: the ids the bank holds for its prompt and answer) followed
by the new input rendered as a continuation (``ChainHistory``): the old items are not
re-rendered nor re-tokenized, so the bank restores their rows by reference, in memory or from
the disk tier. The chain is kept when the new request has the previous one's ``instructions``
and ``tools``; with others (OpenAI does not carry ``instructions`` over) the conversation is
rendered anew under them and the bank reuses what still matches. When the chain's rows were
evicted everywhere (no memory rows, no disk tier), or the model changed, the conversation is
rebuilt from the stored items, re-rendered and recomputed (``turnkv_responses_rebuilt_total``).
Two requests naming one id are two branches: each continues the same chain.

``store`` (default true) keeps the response for ``GET``, ``DELETE`` and later
``previous_response_id``; records belong to the request's namespace (key), as the bank's rows do.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter

from turnkv.bank.response_store import ResponseStore, StoredResponse
from turnkv.bank.response_store_redis import RedisResponseStore
from turnkv.bank.shared_stores import RedisStore
from turnkv.chat_format.history import ChainHistory, ChatHistory
from turnkv.chat_format.structured import (
    ChatFormatError,
    JsonFormat,
    Named,
    Structure,
    chat_structure,
    check_arguments,
    check_tools,
)
from turnkv.chat_format.toolcalls import template_message
from turnkv.engine.events import Failed, GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.models.generation import SamplingDefaults
from turnkv.server.body import read_body
from turnkv.server.guard import require_json
from turnkv.server.openapi import DELETED_RESPONSE, RESPONSES_ROUTE, STORED_RESPONSE
from turnkv.server.responses import note_usage, route_label
from turnkv.server.responses_schema import (
    FunctionCallItem,
    ResponsesRequest,
    TextFormat,
    call_names,
    to_messages,
)
from turnkv.server.responses_stream import EventNumbers, Output, finished, new_id, usage
from turnkv.server.schemas import ApiError, bad_request, parse_body
from turnkv.server.stream import failed_error

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"  # as server.app reads it
RESPONSE_ID = "turnkv.response_id"  # an ASGI scope key: the id a replica's front chose (serve_ray)


def not_found(response_id: str, param: str | None = None) -> ApiError:
    what = "Previous response" if param else "Response"
    return ApiError(
        404,
        f"{what} with id '{response_id[:200]}' not found. It was never stored (store: false), was "
        "deleted, or expired from this server's response store.",
        "invalid_request_error",
        code="previous_response_not_found" if param else "response_not_found",
        param=param,
    )


def store_down(exc: ConnectionError) -> ApiError:
    """A response store (Redis) that does not answer: the request can be retried."""
    return ApiError(
        503, f"{exc}; stored responses cannot be read now", "server_error", code="store_unreachable"
    )


async def in_store(fn, *args):
    """``fn(*args)`` of the response store in a thread; a store that does not answer is a 503."""
    try:
        return await asyncio.to_thread(fn, *args)
    except ConnectionError as exc:
        raise store_down(exc) from None


def json_format(fmt: TextFormat | None) -> JsonFormat | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JsonFormat(None, "text.format")
    return JsonFormat(fmt.schema_, "text.format.schema")


@dataclass
class Plan:
    """A request made ready for the engine: prompt ids, what the turn banks, the answer's
    structure, and the conversation it continues (``messages``: without the instructions)."""

    ids: list[int]
    history: ChatHistory | ChainHistory
    structure: Structure
    messages: list[dict]
    instructions: str | None
    tools: list[dict] | None


class ResponsesApi:
    """The routes' state: the server (``server.app.Server``) and the response store."""

    def __init__(self, srv, store: ResponseStore) -> None:
        self.srv = srv
        self.store = store
        self.rebuilt = Counter(
            "turnkv_responses_rebuilt",
            "previous_response_id chains re-rendered and recomputed from their stored items",
            registry=srv.metrics.registry,
        )

    def sampling(self, req: ResponsesRequest) -> SamplingParams:
        d = SamplingDefaults(req.temperature, req.top_p, None).over(self.srv.engine.sampling_defaults.values)
        return SamplingParams(temperature=d.temperature, top_p=d.top_p, top_k=max(d.top_k, 0))

    def structure(self, req: ResponsesRequest, tools: list[dict] | None) -> Structure:
        srv = self.srv
        choice = req.chat_tool_choice()
        named = req.tool_choice is not None and not isinstance(req.tool_choice, str)
        try:
            check_tools(tools, Named(choice) if named else choice)
            st = chat_structure(
                srv.grammars,
                srv.engine.tokenizer.chat_template,
                json_format(req.text.format if req.text else None),
                tools,
                Named(choice) if named else choice,
                req.parallel_tool_calls,
            )
        except ChatFormatError as e:
            raise bad_request(e.message, param=e.param) from None
        if st.grammar is not None and srv.effective.grammars_off is not None:
            raise bad_request(srv.effective.grammars_off, param="tool_choice" if st.plan else "text.format")
        return st

    def prepare(self, req: ResponsesRequest, namespace: str) -> Plan:
        """Render and tokenize ``req`` (in the handler's thread pool)."""
        srv, tok = self.srv, self.srv.engine.tokenizer
        prev = None
        if req.previous_response_id is not None:
            try:
                prev = self.store.get(req.previous_response_id, namespace)
            except ConnectionError as exc:
                raise store_down(exc) from None
            if prev is None:
                raise not_found(req.previous_response_id, "previous_response_id")
        items = req.items()
        for i, item in enumerate(items):
            if isinstance(item, FunctionCallItem):
                try:
                    check_arguments(item.arguments, f"input[{i}].arguments")
                except ChatFormatError as e:
                    raise bad_request(e.message, param=e.param) from None
        tools = req.chat_tools()
        st = self.structure(req, tools)
        before = prev.messages if prev is not None else []
        conversation = before + to_messages(items, call_names(before))
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        messages = system + conversation
        text = srv.prompts.chat_text(messages, tools, param="input")
        plan = st.plan
        rest = ChatHistory(
            tok, messages, tools, plan.fmt.name if plan else None, plan.max_calls if plan else None
        )
        history: ChatHistory | ChainHistory = rest
        if prev is not None and prev.instructions == req.instructions and prev.tools == tools:
            if self.chain_alive(prev, namespace):
                history = ChainHistory(tok, tuple(prev.chain), prev.chain_text, rest)
            else:
                self.rebuilt.inc()
        ids = history.continued(text) if isinstance(history, ChainHistory) else tok.encode(text)
        return Plan(ids, history, st, conversation, req.instructions, tools)

    def chain_alive(self, prev: StoredResponse, namespace: str) -> bool:
        """Whether ``prev``'s chain is restored rather than rebuilt: same model, and its rows all
        in memory or a disk tier that may hold them (a tier is asked only at admission, and what it
        lost is recomputed from the chain's own ids). A chain the memory bank holds in part (its
        system prompt, shared with other conversations) is rebuilt: re-rendered, its ids are the
        ones a fresh request would send, and the bank still reuses every row they share."""
        srv = self.srv
        if prev.fingerprint != srv.engine.info.fingerprint:
            return False
        tier = srv.bank.tier  # a TierChain (RAM, disk, either None), or none at all
        if tier is not None and (not hasattr(tier, "parts") or tier.parts()):
            return True
        return srv.bank.lookup(namespace, prev.chain)[0] >= len(prev.chain)

    def response(self, rid: str, req: ResponsesRequest, params: SamplingParams) -> dict:
        """The response object before any output (``status: in_progress``)."""
        choice = req.tool_choice
        fmt = req.text.format if req.text and req.text.format else None
        return {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.srv.engine.info.model_name,
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice.model_dump()
            if choice is not None and not isinstance(choice, str)
            else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "truncation": "disabled",
            "usage": None,
            "metadata": req.metadata or {},
            "user": req.user,
        }

    def keep(self, rid: str, namespace: str, plan: Plan, output: Output, answer: str, response: dict) -> None:
        """Store the finished response: the chain the bank holds for it and its conversation."""
        history = plan.history
        calls = [
            {
                "id": c["call_id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in output.calls()
        ]
        said = template_message({"role": "assistant", "content": output.text(), "tool_calls": calls or None})
        rec = StoredResponse(
            rid,
            namespace,
            time.time(),
            self.srv.engine.info.fingerprint,
            history(answer),
            history.text(answer),
            [*plan.messages, said],
            plan.instructions,
            plan.tools,
            response,
        )
        try:
            self.store.put(rec)
        except ConnectionError as exc:  # the answer still goes out; a follow-up naming it is a 404
            log.warning("response %s not stored: %s", rid, exc)


async def create(api: ResponsesApi, request: Request) -> Response:
    srv = api.srv
    ns = srv.namespace(request, None)  # the key, then the content type, before the body is read
    require_json(request.scope["headers"])
    req = parse_body(ResponsesRequest, await read_body(request, srv.max_body_bytes, srv.body_timeout))
    srv.check_model(req.model)
    params = api.sampling(req)
    plan = await asyncio.to_thread(api.prepare, req, ns)
    turn = TurnRequest(
        plan.ids,
        params,
        max_tokens=req.max_output_tokens,
        namespace=ns,
        session=request.headers.get(SESSION_HEADER),
        render_history=plan.history,
        grammar=plan.structure.grammar,
    )
    stream = srv.stream(turn, request)
    admitted = await stream.start()
    rid = request.scope.get(RESPONSE_ID) or new_id("resp")  # not a header: clients cannot set it
    base = api.response(rid, req, params)
    output = Output(plan.structure.plan)
    route = route_label(request)
    pieces: list[str] = []

    async def finish(ev: GenEvent) -> dict:
        stats = ev.stats
        srv.metrics.request(route, 200)
        srv.metrics.turn(stats)
        note_usage(request, admitted, stats.completion_tokens, ev.finish_reason)
        use = usage(
            admitted.prompt_tokens, stats.cached_tokens, stats.completion_tokens, admitted.cache_break
        )
        final = finished(base, output, ev.finish_reason, use)
        if req.store and ev.finish_reason != "cancelled":
            await asyncio.to_thread(api.keep, rid, ns, plan, output, "".join(pieces), final)
        return final

    if not req.stream:
        async for ev in stream:
            if isinstance(ev, Failed):
                raise failed_error(ev)
            if isinstance(ev, GenEvent):
                pieces.append(ev.text)
                output.push(ev.text, last=ev.finish_reason is not None)
                if ev.finish_reason is not None:
                    return JSONResponse(await finish(ev))
        raise ApiError(500, "the turn ended without an answer", "server_error")

    async def events():
        seq = EventNumbers()
        yield seq.sse({"type": "response.created", "response": base})
        yield seq.sse({"type": "response.in_progress", "response": base})
        try:
            async for ev in stream:
                if isinstance(ev, Failed):
                    err = failed_error(ev)
                    srv.metrics.request(route, err.status)
                    failed = {**base, "status": "failed", "error": {"code": ev.code, "message": ev.message}}
                    yield seq.sse({"type": "response.failed", "response": failed})
                    return
                if not isinstance(ev, GenEvent):
                    continue
                pieces.append(ev.text)
                for event in output.push(ev.text, last=ev.finish_reason is not None):
                    yield seq.sse(event)
                if ev.finish_reason is not None:
                    final = await finish(ev)
                    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                    yield seq.sse({"type": kind, "response": final})
                    return
        finally:
            stream.cancel()  # the client went away or we are done; the worker still banks
            if getattr(request.state, "usage", None) is None:
                note_usage(request, admitted, len(pieces), "cancelled")

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def open_store(srv) -> ResponseStore | RedisResponseStore:
    """``responses.sqlite`` in the disk tier's directory, in the disk tier's Redis (what replicas
    over ``--disk-store redis://`` share), or in memory without a disk tier (or when that file
    cannot be opened: logged, and ids then last as long as the process)."""
    tier = srv.bank.tier
    disk = getattr(tier, "disk", tier)  # a TierChain's disk part, or the disk tier itself
    store = getattr(disk, "store", None)
    if isinstance(store, RedisStore):
        return RedisResponseStore(store.target, prefix=store.prefix)
    root = getattr(store, "root", None)
    if root is None:
        return ResponseStore()
    try:
        return ResponseStore.beside(Path(root))
    except (OSError, sqlite3.Error) as exc:
        log.warning("responses store in %s unusable (%s): stored responses stay in memory", root, exc)
        return ResponseStore()


def register_responses_api(app: FastAPI, srv) -> ResponsesApi:
    """Add the Responses routes to ``app`` (served by ``srv``, ``server.app.Server``)."""
    api = ResponsesApi(srv, open_store(srv))

    @app.post("/v1/responses", **RESPONSES_ROUTE)
    async def _create(request: Request) -> Response:
        return await create(api, request)

    @app.get("/v1/responses/{response_id}", **STORED_RESPONSE)
    async def _get(request: Request, response_id: str) -> dict:
        rec = await in_store(api.store.get, response_id, srv.namespace(request, None))
        if rec is None:
            raise not_found(response_id)
        return rec.response

    @app.delete("/v1/responses/{response_id}", **DELETED_RESPONSE)
    async def _delete(request: Request, response_id: str) -> dict:
        if not await in_store(api.store.delete, response_id, srv.namespace(request, None)):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return api


__all__ = ["ResponsesApi", "register_responses_api"]
