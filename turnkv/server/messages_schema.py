"""Request bodies of Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``)
and their adapter to what the chat template renders.

Parsed as the OpenAI bodies are (``schemas._Body``: strict, ``null`` is the default, unknown fields
accepted and ignored: ``thinking``, ``service_tier``, ``cache_control`` on a block). A field that
would change the answer and cannot be honoured is a 400 naming it: image and document blocks,
server tools (``type`` other than ``custom``), a ``tool_result`` whose ``tool_use_id`` names no
earlier ``tool_use``.

The adapter ``Conversation`` renders a body as OpenAI-shaped template messages, so the one chat
template, tool plan and history of ``chat_format`` serve both APIs:

- ``system`` (a string or text blocks, joined by a newline) is the first message, ``system``;
- a ``user`` message's ``tool_result`` blocks are ``tool`` messages (``tool_call_id``, the tool's
  name from its ``tool_use``; the content a string or text blocks), its text blocks a ``user``
  message, in the order they come;
- an ``assistant`` message's text blocks are its content and its ``tool_use`` blocks its
  ``tool_calls`` (``input`` as the arguments object); ``thinking`` blocks are left out (the model
  here never writes them);
- ``tools`` are ``{"type": "function", "function": {name, description, parameters: input_schema}}``
  and ``tool_choice`` ``auto``/``any``/``tool``/``none`` is ``auto``/``required``/the named
  function/``none`` (``disable_parallel_tool_use``: at most one call).

Claude Code sends ``x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=...;`` as
its first system block; ``cch`` changes on every request. Those lines are left out of the prompt
(``strip_billing``: ``--strip-billing-header``, on by default), so the rest of the prompt stays
one cached prefix.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from turnkv.chat_format.structured import Named, ToolChoice
from turnkv.chat_format.toolcalls import NAME, template_message
from turnkv.engine.sampling import SamplingParams
from turnkv.models.generation import SamplingDefaults
from turnkv.server.schemas import _Body, refused

BILLING_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE | re.IGNORECASE)
UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "container_upload")


def strip_billing(text: str) -> str:
    """``text`` without Claude Code's per-request ``x-anthropic-billing-header:`` lines."""
    return BILLING_LINE.sub("", text)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(b.text for b in self.content)


class ThinkingBlock(_Body):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: list[Block]  # a string is one text block

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        """A string is one text block (so a bad block's error names the block, not the string);
        a block this server cannot read is a 400 that says so (not pydantic's tag error)."""
        blocks = data.get("content") if isinstance(data, dict) else None
        if isinstance(blocks, str):
            return {**data, "content": [{"type": "text", "text": blocks}]}
        for j, block in enumerate(blocks if isinstance(blocks, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in UNSUPPORTED_BLOCKS or (isinstance(kind, str) and kind.startswith("server_tool")):
                raise refused(
                    f"content[{j}].type",
                    f"content[{j}]: {kind} blocks are not supported (this server reads text, tool_use "
                    "and tool_result blocks)",
                )
        return data

    @model_validator(mode="after")
    def _blocks_of_the_role(self) -> Message:
        wrong = ToolResultBlock if self.role == "assistant" else ToolUseBlock
        for j, block in enumerate(self.content):
            if isinstance(block, wrong):
                raise ValueError(f"content[{j}]: {block.type} blocks belong in {_other(self.role)} messages")
        return self


def _other(role: str) -> str:
    return "user" if role == "assistant" else "assistant"


class ToolDef(_Body):
    name: str
    description: str | None = None
    input_schema: dict
    type: str | None = None  # "custom" or none; a server tool's type is refused

    @model_validator(mode="before")
    @classmethod
    def _custom(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise refused(
                "tools",
                f"server tools ({str(kind)[:60]!r}) are not supported; define a custom tool with "
                "name, description and input_schema",
            )
        return data

    @model_validator(mode="after")
    def _named(self) -> ToolDef:
        if not NAME.match(self.name):
            raise ValueError(f"tool names must match ^[a-zA-Z0-9_-]{{1,64}}$ (got {self.name[:80]!r})")
        return self

    def template(self) -> dict:
        fn = {"name": self.name, "description": self.description, "parameters": self.input_schema}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class ToolChoiceSpec(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoiceSpec:
        if self.type == "tool" and not self.name:
            raise ValueError('a tool_choice of type "tool" needs the tool\'s name')
        return self

    def choice(self) -> ToolChoice:
        if self.type == "tool":
            assert self.name is not None  # _named
            return Named(self.name)
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]  # type: ignore[return-value]


class Metadata(_Body):
    user_id: str | None = None


class CountTokensRequest(_Body):
    """The body of ``/v1/messages/count_tokens``: the prompt part of a Messages body."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoiceSpec | None = None
    cache_salt: str | None = None  # turnkv's extension, as on the OpenAI routes: adds to the namespace

    @model_validator(mode="after")
    def _results_answer_calls(self) -> CountTokensRequest:
        """Each ``tool_result`` answers a ``tool_use`` of an earlier assistant message."""
        seen: set[str] = set()
        for i, m in enumerate(self.messages):
            for j, b in enumerate(m.content):
                if isinstance(b, ToolUseBlock):
                    seen.add(b.id)
                elif isinstance(b, ToolResultBlock) and b.tool_use_id not in seen:
                    raise refused(
                        f"messages[{i}].content[{j}].tool_use_id",
                        f"messages[{i}].content[{j}]: tool_use_id {b.tool_use_id[:80]!r} answers no "
                        "tool_use block of an earlier assistant message",
                    )
        return self


Temperature = Annotated[float, Field(ge=0.0, le=1.0)]  # Anthropic's range
TopP = Annotated[float, Field(gt=0.0, le=1.0)]


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]  # required, as with Anthropic
    stop_sequences: list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # 0: off
    stream: bool = False
    metadata: Metadata | None = None


class Conversation:
    """A parsed Messages body as the server's turn takes it (``Server.prepare`` / ``open_turn``);
    ``strip``: leave the billing lines out of the system text."""

    def __init__(self, body: CountTokensRequest, strip: bool) -> None:
        self.body = body
        self.strip = strip
        self.model = body.model
        self.cache_salt = body.cache_salt

    # -- the turn -----------------------------------------------------------------------------
    def sampling(self, vocab_size: int, defaults: SamplingDefaults) -> SamplingParams:
        b = self.body
        assert isinstance(b, MessagesRequest)
        d = SamplingDefaults(b.temperature, b.top_p, b.top_k).over(defaults)
        stops = tuple(s for s in b.stop_sequences or () if s)
        return SamplingParams(temperature=d.temperature, top_p=d.top_p, top_k=max(d.top_k, 0), stop=stops)

    def requested_max_tokens(self) -> int:
        assert isinstance(self.body, MessagesRequest)
        return self.body.max_tokens

    def logprobs_top(self) -> None:
        return None

    # -- the prompt ---------------------------------------------------------------------------
    def raw_tools(self) -> list[dict] | None:
        return [t.template() for t in self.body.tools] if self.body.tools else None

    def tool_choice(self) -> ToolChoice | None:
        spec = self.body.tool_choice
        return spec.choice() if spec is not None else None

    def parallel(self) -> bool:
        spec = self.body.tool_choice
        return not (spec is not None and spec.disable_parallel_tool_use)

    def system_text(self) -> str:
        system = self.body.system
        parts = [system] if isinstance(system, str) else [b.text for b in system or ()]
        if self.strip:
            parts = [strip_billing(p) for p in parts]
        return "\n".join(p for p in parts if p)

    def template_messages(self) -> list[dict]:
        """The conversation as OpenAI-shaped messages for the chat template (the module doc)."""
        out: list[dict] = []
        system = self.system_text()
        if system:
            out.append({"role": "system", "content": system})
        names: dict[str, str] = {}  # tool_use id -> the tool's name
        for m in self.body.messages:
            if m.role == "assistant":
                out.append(_assistant(m.content, names))
                continue
            text: list[str] = []
            for b in m.content:
                if isinstance(b, TextBlock):
                    text.append(b.text)
                elif isinstance(b, ToolResultBlock):
                    if text:
                        out.append({"role": "user", "content": "".join(text)})
                        text = []
                    tool = {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                    out.append(template_message({**tool, "name": names.get(b.tool_use_id)}))
            if text or not m.content:
                out.append({"role": "user", "content": "".join(text)})
        return out


def _assistant(blocks: list, names: dict[str, str]) -> dict:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    calls = []
    for b in blocks:
        if isinstance(b, ToolUseBlock):
            names[b.id] = b.name
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
    return template_message({"role": "assistant", "content": text, "tool_calls": calls or None})
