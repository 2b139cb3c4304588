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

from turnkv.kv.cache import common_prefix_len
from turnkv.server.schemas import ApiError, ChatMessage, bad_request
from turnkv.toolcalls import parse

if TYPE_CHECKING:
    from turnkv.server.structured import ToolPlan

BOUND_MIN_BYTES = 64 << 10  # texts shorter than this are just tokenized (well under a millisecond)
BOUND_MARGIN_BYTES = 4  # decoding one token alone may drop a leading space some decoders add in context


def longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes any single token id decodes to (special tokens included), plus a margin."""
    backend = tokenizer.backend
    pieces = backend.decode_batch([[i] for i in range(backend.get_vocab_size())], skip_special_tokens=False)
    return max((len(p.encode()) for p in pieces), default=1) + BOUND_MARGIN_BYTES


def context_error(limit: int, prompt: str) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your prompt has {prompt} "
        f"tokens (at least one more is needed to answer). Shorten the messages.",
        code="context_length_exceeded",
        param="messages",
    )


History = Callable[[str], list[int]]


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

    def chat(
        self, messages: list[dict], tools: list[dict] | None = None, plan: ToolPlan | None = None
    ) -> tuple[list[int], History]:
        """Prompt ids of ``messages`` (and ``tools``, rendered by the template) and the history
        renderer the bank's rebase uses (``plan``: the answer is read as tool calls)."""
        tok = self.tokenizer
        extra = {"tools": tools} if tools else {}
        try:
            text = tok.render_chat(messages, **extra)
        except ValueError as e:
            raise bad_request(f"the prompt cannot be built: {e}", param="messages") from None
        self.check_bound(text)
        ids = tok.encode(text)

        def history(answer: str) -> list[int]:
            if not tools:
                return tok.apply_chat_template(
                    [*messages, {"role": "assistant", "content": answer}], add_generation_prompt=False
                )
            try:
                return tok.encode(self.next_turn_prefix(messages, answer_message(answer, plan), extra))
            except ValueError:  # the template refuses the answer's message: bank it as generated
                return tok.encode(text + answer)

        return ids, history

    def next_turn_prefix(self, messages: list[dict], answer: dict, extra: dict) -> str:
        """The text the next request of an agent loop starts with: the history, the answer as the
        template renders it once another message follows (a ``tool`` message after calls, else a
        ``user`` one) and that message's opening. Templates render the last assistant message
        differently from an earlier one (Qwen3 drops an empty think block): rendering it as the
        next request will lets the bank hold exactly the rows that request reuses."""
        tok = self.tokenizer
        role = "tool" if answer.get("tool_calls") else "user"
        try:
            a, b = (
                tok.render_chat(
                    [*messages, answer, {"role": role, "content": probe}],
                    add_generation_prompt=False,
                    **extra,
                )
                for probe in ("0", "1")
            )
            return a[: common_prefix_len(a, b)]
        except ValueError:  # a template that refuses the probe: the answer as the last message
            return tok.render_chat([*messages, answer], add_generation_prompt=False, **extra)

    def completion(self, prompt: str | list[int]) -> tuple[list[int], History | None]:
        """Prompt ids of a raw completion prompt (text, or token ids checked against the vocabulary)."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            text = prompt
            self.check_bound(text)
            return tok.prompt_text(text), lambda answer: tok.prompt_text(text + answer)
        ids = list(prompt)
        vocab = tok.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
        return ids, None


def answer_message(answer: str, plan: ToolPlan | None) -> dict:
    """The assistant message a client sends back after ``answer`` (its calls parsed as the response
    reported them), as the chat template takes it."""
    wire: dict = {"role": "assistant", "content": answer}
    if plan is not None:
        content, calls = parse(plan.fmt, answer, plan.max_calls)
        wire["content"] = content or None
        if calls:
            wire["tool_calls"] = [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for i, c in enumerate(calls)
            ]
    return ChatMessage.model_validate(wire).template()
