"""``POST /tokenize`` and ``POST /detokenize``, as vLLM names them.

``/tokenize`` takes ``prompt`` (a text; ``add_special_tokens`` default true: the BOS a model wants,
as ``/v1/completions`` tokenizes a prompt) or ``messages`` (the chat template applied, with
``add_generation_prompt`` (default true) and ``tools``; ``add_special_tokens`` default false: the
template writes its own), and answers ``{"count", "max_model_len", "tokens"}`` (plus
``token_strs`` with ``return_token_strs``). ``/detokenize`` takes ``tokens`` and answers
``{"prompt"}``, special tokens kept. Both need the key as ``/v1`` does; a bad body is a 400 in the
OpenAI shape naming the field (both ``prompt`` and ``messages``, neither, an id outside the
vocabulary). The ids are what the generation routes would prefill: the same tokenizer and template.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, model_validator

from turnkv.server.openapi import KEYED, REF, errors
from turnkv.server.schemas import ChatMessage, Tool, _Body, bad_request, refused

if TYPE_CHECKING:
    from turnkv.server.app import Server


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise refused("prompt", "send exactly one of prompt (a text) or messages (a chat)")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(json_schema_extra={"minimum": 0})]]


class Tokenized(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class Detokenized(BaseModel):
    prompt: str


def _route(body: type[BaseModel], answer: type[BaseModel]) -> dict:
    """Route keywords: the body ``/openapi.json`` describes, the answer and the errors."""
    content = {"application/json": {"schema": {"$ref": REF.format(model=body.__name__)}}}
    return {
        "response_model": None,
        "responses": {200: {"model": answer}, **errors(*KEYED, 404, 408, 413, 415)},
        "openapi_extra": {"requestBody": {"required": True, "content": content}},
    }


def tokenize(srv: Server, req: TokenizeRequest) -> dict:
    """The answer of ``/tokenize`` (in the handler's thread pool: rendering and tokenizing)."""
    tok = srv.engine.tokenizer
    if req.messages is not None:
        tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools] if req.tools else None
        text = srv.prompts.chat_text([m.template() for m in req.messages], tools, req.add_generation_prompt)
        special = bool(req.add_special_tokens)
    else:
        text, special = req.prompt or "", req.add_special_tokens is not False
        srv.prompts.check_bound(text)
    ids = tok.encode(text, add_special_tokens=special)
    out: dict = {"count": len(ids), "max_model_len": srv.engine.max_context, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [srv.logprobs.piece(i)[0] for i in ids]
    return out


def detokenize(srv: Server, req: DetokenizeRequest) -> dict:
    vocab = srv.engine.tokenizer.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(
            f"tokens[{bad}]: token id {req.tokens[bad]} is outside the vocabulary [0, {vocab})",
            param="tokens",
        )
    return {"prompt": srv.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def register_tokenize(app: FastAPI, srv: Server) -> None:
    @app.post("/tokenize", **_route(TokenizeRequest, Tokenized))
    async def _tokenize(request: Request) -> dict:
        req = await srv.read_request(request, TokenizeRequest)
        return await asyncio.to_thread(tokenize, srv, req)

    @app.post("/detokenize", **_route(DetokenizeRequest, Detokenized))
    async def _detokenize(request: Request) -> dict:
        req = await srv.read_request(request, DetokenizeRequest)
        return await asyncio.to_thread(detokenize, srv, req)
