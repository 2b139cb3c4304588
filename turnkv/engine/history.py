"""What a turn re-renders once its answer is known (``TurnRequest.render_history``), as records.

A chat request's history is its messages plus the answer as the assistant's message, through
the chat template; a completion's is its prompt text plus the answer. They are records rather
than closures so rank 0 of a tensor-parallel group can send them to the other ranks, which
render them with their own tokenizer (``turnkv.parallel.control``): every rank must bank the
same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from turnkv.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatHistory:
    """``messages`` re-rendered with ``answer`` appended as the assistant's message."""

    tokenizer: Tokenizer = field(repr=False, compare=False)
    messages: list[dict]

    def __call__(self, answer: str) -> list[int]:
        return self.tokenizer.apply_chat_template(
            [*self.messages, {"role": "assistant", "content": answer}], add_generation_prompt=False
        )


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
        return ("chat", history.messages)
    if isinstance(history, TextHistory):
        return ("text", history.text)
    raise TypeError(
        f"render_history {type(history).__name__} cannot be replayed on other ranks "
        "(use turnkv.engine.history.ChatHistory or TextHistory)"
    )


def history_from_spec(spec: tuple[str, object] | None, tokenizer: Tokenizer):
    """The history of ``history_spec``, rendering with ``tokenizer``."""
    if spec is None:
        return None
    kind, data = spec
    return ChatHistory(tokenizer, data) if kind == "chat" else TextHistory(tokenizer, data)
