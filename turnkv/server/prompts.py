"""A request's prompt as token ids, made in the HTTP handler's thread pool.

The chat template is rendered and tokenized by ``asyncio.to_thread`` in the handler, so neither the
event loop (other clients' requests and streams) nor the engine thread (other clients' tokens)
waits for it; the engine receives token ids. A prompt that cannot fit the context is refused
before it is tokenized in full: no token decodes to more than ``max_token_bytes`` bytes, so a text
of ``b`` UTF-8 bytes has at least ``b / max_token_bytes`` tokens (measured for the default model:
81 bytes, a newline and 80 spaces). Before this, a 20 MB chat body was tokenized on the engine
thread for 18.3 s while a concurrent "Hi" waited 17.5 s.

This module never imports fastapi; its errors are :class:`ApiError` (400).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from turnkv.chat_format.history import ChatHistory, TextHistory
from turnkv.engine.admission import prompt_too_long
from turnkv.server.schemas import ApiError, bad_request

if TYPE_CHECKING:
    from turnkv.chat_format.structured import ToolPlan

BOUND_MIN_BYTES = 64 << 10  # texts shorter than this are just tokenized (well under a millisecond)
BOUND_MARGIN_BYTES = 4  # decoding one token alone may drop a leading space some decoders add in context


def longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes any single token id decodes to (special tokens included), plus a margin."""
    backend = tokenizer.backend
    pieces = backend.decode_batch([[i] for i in range(backend.get_vocab_size())], skip_special_tokens=False)
    return max((len(p.encode()) for p in pieces), default=1) + BOUND_MARGIN_BYTES


def context_error(limit: int, prompt: str) -> ApiError:
    return ApiError(400, prompt_too_long(limit, prompt), code="context_length_exceeded", param="messages")


History = Callable[[str], list[int]]  # ChatHistory / TextHistory: records, sendable to other ranks


class Prompts:
    """Renders and tokenizes prompts for one engine (``max_context`` 0: no limit)."""

    def __init__(self, tokenizer, max_context: int) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.max_token_bytes = longest_token_bytes(tokenizer)

    def check_bound(self, text: str) -> None:
        """Refuse ``text`` if even its fewest possible tokens overflow the context; cheap (no tokenizer)."""
        if not self.max_context or len(text) < BOUND_MIN_BYTES // 4:
            return
        nbytes = len(text.encode("utf-8", "surrogatepass"))
        least = -(-nbytes // self.max_token_bytes)
        if nbytes >= BOUND_MIN_BYTES and least + 1 > self.max_context:
            raise context_error(self.max_context, f"at least {least} ({nbytes} bytes)")

    def chat_text(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        param: str = "messages",
    ) -> str:
        """The template's text of ``messages`` (and ``tools``), checked against the context bound;
        a template that refuses them is a 400 naming ``param`` (the body field they came from)."""
        extra = {"tools": tools} if tools else {}
        try:
            text = self.tokenizer.render_chat(messages, add_generation_prompt, **extra)
        except ValueError as e:
            raise bad_request(f"the prompt cannot be built: {e}", param=param) from None
        self.check_bound(text)
        return text

    def chat(
        self, messages: list[dict], tools: list[dict] | None = None, plan: ToolPlan | None = None
    ) -> tuple[list[int], History]:
        """Prompt ids of ``messages`` (and ``tools``, rendered by the template) and the history
        renderer the bank's rebase uses (``plan``: the answer is read as tool calls)."""
        tok = self.tokenizer
        ids = tok.encode(self.chat_text(messages, tools))
        if plan is None:
            return ids, ChatHistory(tok, messages, tools or None)
        return ids, ChatHistory(
            tok, messages, tools or None, plan.fmt.name, plan.max_calls, plan.calls_as_input
        )

    def completion(self, prompt: str | list[int]) -> tuple[list[int], History | None]:
        """Prompt ids of a raw completion prompt (text, or token ids checked against the vocabulary)."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            text = prompt
            self.check_bound(text)
            return tok.prompt_text(text), TextHistory(tok, text)
        ids = list(prompt)
        vocab = tok.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
        return ids, None
