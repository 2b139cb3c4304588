"""What a turn re-renders once its answer is known (``TurnRequest.render_history``), as records.

A chat request's history is its messages plus the answer as the assistant's message, through
the chat template; a completion's is its prompt text plus the answer. They are records rather
than closures so rank 0 of a tensor-parallel group can send them to the other ranks, which
render them with their own tokenizer (``turnkv.parallel.control``): every rank must bank the
same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from turnkv.chat_format.toolcalls import FORMATS, call_input, parse, template_message
from turnkv.kv.cache import common_prefix_len
from turnkv.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatHistory:
    """``messages`` re-rendered with ``answer`` appended as the assistant's message.

    With ``tools`` (what the template renders) the history is the text the *next* request of an
    agent loop starts with (``next_turn_prefix``): the answer as an assistant message (its calls
    parsed in format ``tool_format``, at most ``max_calls``, as the response reported them) and
    the opening of the message that follows it. ``calls_as_input``: the API reports a call's
    arguments as an object (the Messages API's ``input``: ``call_input``), so a call cut by
    ``max_tokens`` comes back as the partial object, not as the text generated (OpenAI's
    ``arguments`` string, which comes back as it was)."""

    tokenizer: Tokenizer = field(repr=False, compare=False)
    messages: list[dict]
    tools: list[dict] | None = None
    tool_format: str | None = None  # a key of toolcalls.FORMATS; None: the answer is content
    max_calls: int | None = None
    calls_as_input: bool = False

    def __call__(self, answer: str) -> list[int]:
        return self.tokenizer.encode(self.text(answer))

    def text(self, answer: str) -> str:
        """The chat-template text whose ids ``__call__`` returns."""
        tok = self.tokenizer
        if not self.tools:
            return tok.render_chat(
                [*self.messages, {"role": "assistant", "content": answer}], add_generation_prompt=False
            )
        try:
            return self.next_turn_prefix(self.answer_message(answer))
        except ValueError:  # the template refuses the answer's message: bank it as generated
            return tok.render_chat(self.messages, tools=self.tools) + answer

    def answer_message(self, answer: str) -> dict:
        """The assistant message a client sends back after ``answer``, as the template takes it."""
        if self.tool_format is None:
            return {"role": "assistant", "content": answer}
        content, calls = parse(FORMATS[self.tool_format], answer, self.max_calls)
        wire = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": self._arguments(c)},
            }
            for i, c in enumerate(calls)
        ]
        return template_message({"role": "assistant", "content": content or "", "tool_calls": wire or None})

    def _arguments(self, call) -> str | dict:
        return call_input(call.arguments) if self.calls_as_input else call.arguments

    def next_turn_prefix(self, answer: dict) -> str:
        """The text the next request of an agent loop starts with: the history, the answer as the
        template renders it once another message follows (a ``tool`` message after calls, else a
        ``user`` one) and that message's opening. Templates render the last assistant message
        differently from an earlier one (Qwen3 drops an empty think block): rendering it as the
        next request will lets the bank hold exactly the rows that request reuses."""
        tok, extra = self.tokenizer, {"tools": self.tools}
        role = "tool" if answer.get("tool_calls") else "user"
        try:
            a, b = (
                tok.render_chat(
                    [*self.messages, answer, {"role": role, "content": probe}],
                    add_generation_prompt=False,
                    **extra,
                )
                for probe in ("0", "1")
            )
            return a[: common_prefix_len(a, b)]
        except ValueError:  # a template that refuses the probe: the answer as the last message
            return tok.render_chat([*self.messages, answer], add_generation_prompt=False, **extra)


@dataclass(frozen=True)
class ChainHistory:
    """A conversation continued from a banked token chain (the Responses API's
    ``previous_response_id``): ``chain`` (ids) spells ``chain_text``, the start of ``rest``'s
    text; the history is ``chain`` followed by the ids of the rest of that text, so the ids the
    bank held are kept as they were, never re-tokenized. Where ``rest``'s text does not start
    with ``chain_text`` it is ``rest``'s own ids."""

    tokenizer: Tokenizer = field(repr=False, compare=False)
    chain: tuple[int, ...]
    chain_text: str
    rest: ChatHistory

    def __call__(self, answer: str) -> list[int]:
        return self.continued(self.rest.text(answer))

    def text(self, answer: str) -> str:
        return self.rest.text(answer)

    def continued(self, text: str) -> list[int]:
        """Ids of ``text``: the chain, then the rest tokenized, when ``text`` continues the chain."""
        if self.chain and text.startswith(self.chain_text):
            return [*self.chain, *self.tokenizer.encode(text[len(self.chain_text) :])]
        return self.tokenizer.encode(text)


@dataclass(frozen=True)
class TextHistory:
    """A completion's prompt ``text`` followed by ``answer``, tokenized as one text."""

    tokenizer: Tokenizer = field(repr=False, compare=False)
    text: str

    def __call__(self, answer: str) -> list[int]:
        return self.tokenizer.prompt_text(self.text + answer)


def history_spec(history: object) -> tuple[str, object] | None:
    """What another process needs to rebuild ``history`` (None for no history)."""
    if history is None:
        return None
    if isinstance(history, ChatHistory):
        h = history
        return ("chat", (h.messages, h.tools, h.tool_format, h.max_calls, h.calls_as_input))
    if isinstance(history, TextHistory):
        return ("text", history.text)
    if isinstance(history, ChainHistory):
        return ("chain", (history.chain, history.chain_text, history_spec(history.rest)))
    raise TypeError(
        f"render_history {type(history).__name__} cannot be replayed on other ranks "
        "(use turnkv.chat_format.history.ChatHistory or TextHistory)"
    )


def history_from_spec(spec: tuple[str, object] | None, tokenizer: Tokenizer):
    """The history of ``history_spec``, rendering with ``tokenizer``."""
    if spec is None:
        return None
    kind, data = spec
    if kind == "chain":
        chain, chain_text, rest = data
        return ChainHistory(tokenizer, tuple(chain), chain_text, history_from_spec(rest, tokenizer))
    return ChatHistory(tokenizer, *data) if kind == "chat" else TextHistory(tokenizer, data)
