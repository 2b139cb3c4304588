"""``GET /openapi.json``: the server as it is, for clients and for schemathesis.

The POST routes read their bodies themselves (``schemas.parse_body``: strict, with the size cap
and the Content-Type check first), so FastAPI does not see their models; ``document`` adds them
as ``requestBody`` (``application/json``), states every answer in the OpenAI error shape
(``ErrorResponse``) with the statuses the routes give, the stream (``text/event-stream``), and
drops FastAPI's 422 (a validation error here is a 400). ``/docs`` and ``/redoc`` are off: their
pages load Swagger UI and ReDoc from a CDN, and no installed package ships those assets.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from turnkv.server.responses_schema import ResponsesRequest
from turnkv.server.schemas import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"
EVENT_STREAM = "text/event-stream"


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")  # a 507 adds needed_bytes and available_bytes
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class CacheBreakBody(BaseModel):
    reason: Literal["none", "new_conversation", "history_differs", "evicted", "namespace", "not_read"]
    at: int  # prompt tokens reused
    detail: str | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]
    cache_break: CacheBreakBody | None  # turnkv's extension: where the reused prefix ended, and why


class CallFunction(BaseModel):
    name: str
    arguments: str


class AnswerCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CallFunction


class AnswerMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[AnswerCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float  # -9999.0 for a token a grammar masks
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None


class TextLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # null: an echoed prompt's first token (nothing before it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int
    message: AnswerMessage
    logprobs: ChatLogprobs | None  # with "logprobs": true
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: TextLogprobs | None  # with "logprobs": k
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[TextChoice]
    usage: Usage


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    cache_break: CacheBreakBody | None = None
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A Responses-API response (``server.openai_responses``); ``output`` holds ``message`` and
    ``function_call`` items."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None
    previous_response_id: str | None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    sampling_defaults: dict[str, Any]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


ERRORS = {
    400: "invalid request: bad JSON, a wrong type or range, an unsupported field, a prompt too long",
    401: "missing or wrong API key (with --api-key)",
    403: "the Host header names a host this server does not answer (--allowed-hosts)",
    404: "unknown model or route, or a response id this server does not hold",
    408: "the body did not arrive within --body-timeout",
    413: "the body is larger than --max-body-bytes",
    415: "the body is not declared application/json",
    503: "the turn waited past --queue-timeout (Retry-After), a tensor-parallel rank is down, or the "
    "response store (Redis) does not answer",
    507: "the turn does not fit the KV budget (needed_bytes, available_bytes)",
}
EVERY_ROUTE = (400, 403)  # a repeated Host header; a Host the server does not answer
KEYED = (401,)
COMPLETION_ROUTE = (401, 404, 408, 413, 415, 503, 507)


def _ref(model: type[BaseModel]) -> str:
    return REF.format(model=model.__name__)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for ``statuses``, each in the OpenAI error shape."""
    return {s: {"model": ErrorResponse, "description": ERRORS[s]} for s in statuses}


def completion_route(request_model: type[BaseModel], answer: type[BaseModel]) -> dict[str, Any]:
    """Route keywords of a POST completion route: its body, its answers, its errors."""
    ok = {
        "model": answer,
        "description": "the whole answer, or with stream true server-sent events ending in data: [DONE]",
        "content": {EVENT_STREAM: {"schema": {"type": "string"}}},
    }
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": _ref(request_model)}}}}
    return {"responses": {200: ok, **errors(*COMPLETION_ROUTE)}, "openapi_extra": {"requestBody": body}}


CHAT_ROUTE = completion_route(ChatCompletionRequest, ChatCompletion)
COMPLETIONS_ROUTE = completion_route(CompletionRequest, Completion)
RESPONSES_ROUTE = completion_route(ResponsesRequest, ResponseObject)
STORED_RESPONSE = {
    "response_model": None,
    "responses": {200: {"model": ResponseObject}, **errors(*KEYED, 404, 503)},
}
DELETED_RESPONSE = {
    "response_model": None,
    "responses": {200: {"model": ResponseDeleted}, **errors(*KEYED, 404, 503)},
}


def document(app: FastAPI, bodies: tuple[type[BaseModel], ...] = ()) -> dict[str, Any]:
    """The OpenAPI document of ``app``, built once; ``bodies``: request models of other modules'
    routes (their schemas are components too; passed in, as those modules build on this one)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (
            ChatCompletionRequest,
            CompletionRequest,
            ResponsesRequest,
            *bodies,
        ):
            own = model.model_json_schema(ref_template=REF)
            for name, sub in [*own.pop("$defs", {}).items(), (model.__name__, own)]:
                schemas[name] = _nullable_defaults(sub)
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for ops in doc["paths"].values():
            for op in ops.values():
                op["responses"].pop("422", None)
                for status in EVERY_ROUTE:
                    op["responses"].setdefault(str(status), _error_ref(status))
        app.openapi_schema = doc
    return app.openapi_schema


def _nullable_defaults(schema: dict[str, Any]) -> dict[str, Any]:
    """A request model's schema with ``null`` allowed for each field that has a default: the
    bodies read ``"field": null`` as the default (``schemas._Body``), as the OpenAI API does."""
    for prop in schema.get("properties", {}).values():
        if "default" in prop and prop["default"] is not None:
            options = prop.pop("anyOf", None) or [{k: prop.pop(k) for k in list(prop) if k not in KEEP}]
            prop["anyOf"] = [*options, {"type": "null"}]
    return schema


KEEP = ("default", "title", "description")


def _error_ref(status: int) -> dict[str, Any]:
    schema = {"$ref": _ref(ErrorResponse)}
    return {"description": ERRORS[status], "content": {"application/json": {"schema": schema}}}
