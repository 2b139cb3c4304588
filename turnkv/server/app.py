"""The OpenAI-compatible HTTP server: routes, SSE streaming, API keys, errors.

``create_app(rt)`` builds the FastAPI app around one runtime (``turnkv.runtime``; ``turnkv.server.run`` serves
it under uvicorn). A handler reads the body under ``--max-body-bytes``, validates it, renders and
tokenizes the prompt in a worker thread (``server.prompts``), then submits token ids to the one
:class:`EngineWorker` (one thread running the scheduler: many turns per step) and awaits its
events through a ``TurnStream`` (``server.stream``), which ``server.responses`` turns into a body
or SSE chunks. The first event decides the status (200, or 400/507 before any work); a client
that goes away sets the turn's cancel flag, and the worker still seals and banks what it computed.

Before a handler runs, ``server.guard`` checks the Host (``--allowed-hosts``), and the JSON routes
check the Content-Type and the key before reading the body; ``server.openapi`` describes the
routes at ``/openapi.json`` (behind the key, as ``/v1``).

Namespaces: without ``--api-key`` everyone shares one cache namespace; with keys each key has its
own, and a request's ``cache_salt`` adds to it, so a prefix banked under one namespace never
yields ``cached_tokens`` under another.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from turnkv.bank.session_bank import SessionBank
from turnkv.bank.tiers import TierChain
from turnkv.chat_format.grammar import Grammars
from turnkv.chat_format.structured import Structure
from turnkv.engine.events import Failed, TurnRequest
from turnkv.runtime import Runtime
from turnkv.server.access import AccessLog
from turnkv.server.body import body_limit, read_body
from turnkv.server.dashboard import register_dashboard
from turnkv.server.guard import HostGuard, HostPolicy, matching_key, request_key, require_json
from turnkv.server.health import server_health
from turnkv.server.logprobs import LogprobFormat
from turnkv.server.messages import register_messages
from turnkv.server.metrics import CONTENT_TYPE, Metrics
from turnkv.server.openai_responses import register_responses_api
from turnkv.server.openapi import CHAT_ROUTE, COMPLETIONS_ROUTE, KEYED, ModelCard, ModelList, document, errors
from turnkv.server.prompts import Prompts
from turnkv.server.responses import respond, route_label
from turnkv.server.schemas import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    parse_body,
)
from turnkv.server.stream import TurnStream, failed_error
from turnkv.server.structured import request_structure
from turnkv.server.tokenize import DetokenizeRequest, TokenizeRequest, register_tokenize
from turnkv.server.worker import EngineWorker

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"


class Server:
    """The state behind the routes: engine, bank, worker, metrics, keys."""

    def __init__(self, rt: Runtime, bank: SessionBank | None = None) -> None:
        engine = self.engine = rt.engine
        self.cfg = cfg = rt.cfg
        self.effective = rt.effective
        self.bank = bank if bank is not None else rt.bank
        self.warm_report = rt.warm  # what the warm-up did (None: none ran; ``Runtime.warm_up``)
        scheduler = rt.scheduler(self.bank)
        self.metrics = Metrics(engine, self.bank, lambda: scheduler.snapshot)
        scheduler.pipeline.observe = self.metrics.step
        self.worker = EngineWorker(scheduler)
        if isinstance(self.bank.tier, TierChain):  # RAM pins what the warm-up did not
            self.bank.tier.serving()
        self.keys = {k for k in cfg.api_key if k}
        self.created = int(time.time())
        self.model_names = {engine.info.model_name, cfg.model}
        self.prompts = Prompts(engine.tokenizer, engine.max_context)
        self.max_body_bytes = body_limit(cfg.max_body_bytes, engine.max_context)
        self.body_timeout = cfg.body_timeout
        self.vocab_size = engine.loaded.config.vocab_size  # logits per row: what logit_bias may name
        # tensor parallelism: a rank that dies ends the turns in flight and refuses new ones (503)
        self.group = engine.tp.group if engine.tp is not None else None
        if self.group is not None:
            self.group.on_down.append(lambda reason: self.worker.abort(Failed.group_down(reason)))
        self.grammars = Grammars(engine.tokenizer, self.vocab_size)  # llguidance loads on first use
        self.logprobs = LogprobFormat(engine.tokenizer)

    # -- request helpers ----------------------------------------------------------------------
    def namespace(self, request: Request, salt: str | None) -> str:
        """The cache namespace; raises 401 when keys are set and the request has none of them."""
        ns = "public"
        if self.keys:
            key = matching_key(request_key(request.scope["headers"]), self.keys)
            if key is None:
                raise ApiError(
                    401,
                    "Incorrect API key provided. Pass one of the server's --api-key values as a bearer "
                    "token (or in x-api-key).",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
            ns = "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
        if salt:
            ns += "|salt:" + hashlib.sha256(salt.encode()).hexdigest()[:16]
        return ns

    def prepare(self, req, chat: bool, structure=request_structure) -> tuple[list[int], object, Structure]:
        """Prompt ids, history renderer and answer structure (grammar, tools) of a parsed body
        (``structure(req, grammars, template)`` reads the latter from the API's body); runs in the
        handler's thread pool (rendering, tokenizing, compiling a grammar)."""
        st = structure(req, self.grammars, self.engine.tokenizer.chat_template)
        if chat:
            ids, history = self.prompts.chat(req.template_messages(), st.tools, st.plan)
        else:
            ids, history = self.prompts.completion(req.single_prompt())
        if st.grammar is not None and self.effective.grammars_off is not None:
            raise bad_request(
                self.effective.grammars_off,
                param="tool_choice" if chat and st.plan is not None else "response_format",
            )
        return ids, history, st

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(
                404,
                f"The model `{model[:200]}` does not exist. This server serves `{self.engine.info.model_name}`.",
                "invalid_request_error",
                code="model_not_found",
                param="model",
            )

    def model_card(self) -> dict:
        return {
            "id": self.engine.info.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "turnkv",
            "max_model_len": self.engine.max_context,
            # what a request that sets no temperature, top_p, top_k or max_tokens gets
            "sampling_defaults": self.engine.sampling_defaults.doc(),
        }

    async def read_request(self, request: Request, schema):
        """The parsed body of ``request`` in ``schema``: the key, then the content type, before the
        body is read; then the model it names."""
        self.namespace(request, None)
        require_json(request.scope["headers"])
        req = parse_body(schema, await read_body(request, self.max_body_bytes, self.body_timeout))
        self.check_model(req.model)
        return req

    async def open_turn(
        self, request: Request, req, chat: bool, structure=request_structure
    ) -> tuple[TurnStream, Structure]:
        """The turn of a parsed body ``req`` (what ``prepare`` reads, plus ``cache_salt``,
        ``sampling``, ``requested_max_tokens`` and ``logprobs_top``), submitted."""
        ns = self.namespace(request, req.cache_salt)
        params = req.sampling(self.vocab_size, self.engine.sampling_defaults.values)
        # render, tokenize and compile grammars off the event loop and off the engine thread
        ids, history, st = await asyncio.to_thread(self.prepare, req, chat, structure)
        turn = TurnRequest(
            ids,
            params,
            max_tokens=req.requested_max_tokens(),
            namespace=ns,
            session=request.headers.get(SESSION_HEADER),
            render_history=history,
            grammar=st.grammar,
            logprobs=req.logprobs_top(),
            prompt_logprobs=None if chat else req.prompt_logprobs_top(),
            n=getattr(req, "n", 1),  # chat and completions ask for choices; other APIs answer one
        )
        return self.stream(turn, request), st

    def stream(self, turn: TurnRequest, request: Request) -> TurnStream:
        """The event stream of ``turn`` for ``request``; a 503 while the tensor-parallel group is down."""
        if self.group is not None and not self.group.health.ok:
            raise failed_error(Failed.group_down(self.group.health.error))
        return TurnStream(self.worker.submit, turn, request, self.worker.post)


async def shutdown(srv: Server) -> None:
    """Cancel what still runs (it banks what it computed) and close the tiers, off the event loop
    (the app's lifespan; ``server.warming.WarmGate`` runs it when it serves the app)."""
    await asyncio.to_thread(srv.worker.stop, srv.cfg.shutdown_timeout)
    if srv.bank.tier is not None:
        await asyncio.to_thread(srv.bank.tier.close)  # finishes the queued block writes


def create_app(rt: Runtime, bank: SessionBank | None = None) -> FastAPI:
    """The FastAPI app serving ``rt`` (``runtime.build``); ``bank`` defaults to ``rt.bank``."""
    srv = Server(rt, bank)
    cfg = rt.cfg

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await shutdown(srv)

    # no /docs or /redoc: their pages load their scripts from a CDN (server.openapi)
    app = FastAPI(title="turnkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv

    def refused(scope, status: int) -> None:
        srv.metrics.request(route_label(Request(scope)), status)

    app.add_middleware(HostGuard, policy=HostPolicy(cfg.host, cfg.allowed_hosts), count=refused)
    app.add_middleware(AccessLog, enabled=cfg.access_log)  # outermost: it logs the refusals too

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        srv.metrics.request(route_label(request), exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request"}
        return await _api_error(request, bad_request(str(first.get("msg"))))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return await _api_error(request, ApiError(exc.status_code, str(exc.detail), type_))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return await _api_error(
            request, ApiError(500, f"internal error: {type(exc).__name__}", "server_error")
        )

    @app.get("/health")
    async def _health() -> dict:
        return server_health(srv)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def _metrics() -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/openapi.json", include_in_schema=False)
    async def _openapi(request: Request) -> JSONResponse:
        srv.namespace(request, None)  # 401 without a valid key, as /v1
        return JSONResponse(document(app, (TokenizeRequest, DetokenizeRequest)))

    # response_model=None: documented, not filtered (FastAPI would drop a field the model lacks)
    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **errors(*KEYED)})
    async def _models(request: Request) -> dict:
        srv.namespace(request, None)
        return {"object": "list", "data": [srv.model_card()]}

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=None,
        responses={200: {"model": ModelCard}, **errors(*KEYED, 404)},
    )
    async def _model(request: Request, model_id: str) -> dict:
        srv.namespace(request, None)
        srv.check_model(model_id)
        return srv.model_card()

    async def _serve(request: Request, schema, chat: bool) -> Response:
        req = await srv.read_request(request, schema)
        stream, st = await srv.open_turn(request, req, chat)
        info = srv.engine.info
        echo = "" if chat else req.echo_text(srv.engine.tokenizer)
        return await respond(
            stream, req, srv.metrics, info.model_name, info.fingerprint, chat, st.plan, srv.logprobs, echo
        )

    @app.post("/v1/chat/completions", **CHAT_ROUTE)
    async def _chat(request: Request) -> Response:
        return await _serve(request, ChatCompletionRequest, chat=True)

    @app.post("/v1/completions", **COMPLETIONS_ROUTE)
    async def _completions(request: Request) -> Response:
        return await _serve(request, CompletionRequest, chat=False)

    register_responses_api(app, srv)
    register_dashboard(app, srv)
    register_messages(app, srv)
    register_tokenize(app, srv)
    return app


__all__ = ["Server", "create_app", "shutdown"]
