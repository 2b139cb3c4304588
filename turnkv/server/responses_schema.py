"""The request body of ``POST /v1/responses`` (the OpenAI Responses API), parsed as the other
routes' bodies are (``server.schemas``: strict JSON, ``null`` is the default, unknown fields
ignored, a 400 naming the field for what turnkv cannot honour).

``input`` is a string (one user message) or items: messages (``role`` and ``content`` as a string
or ``input_text`` / ``output_text`` parts; ``type: "message"`` may be left out), ``function_call``
(an earlier call of the model: ``call_id``, ``name``, ``arguments``) and ``function_call_output``
(its result); ``reasoning`` items a client sends back are dropped (this server writes none).
``to_messages`` turns them into chat-template messages: consecutive calls join the assistant
message before them, as a chat-completions client would send them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from turnkv.chat_format.toolcalls import template_message
from turnkv.server.schemas import FunctionDef, Temperature, TopP, _Body, refused


class TextInput(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextInput]
    id: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextInput]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_Body):
    type: Literal["reasoning"]


Item = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")
]


class FunctionTool(FunctionDef):
    """A function tool as the Responses API writes it: the function's fields at the top."""

    type: Literal["function"]

    def chat_tool(self) -> dict:
        """This tool as chat templates render it (the chat-completions shape)."""
        fn = self.model_dump(exclude_none=True, exclude={"type"})
        return {"type": "function", "function": fn}


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError(
                'a json_schema format needs schema ({"type": "json_schema", "name": ..., "schema": {...}})'
            )
        return self


class TextConfig(_Body):
    format: TextFormat | None = None


def _default_type(data: Any) -> Any:
    """A message item may leave ``type`` out (the SDK's ``EasyInputMessage``)."""
    if isinstance(data, dict) and "type" not in data and "role" in data:
        return {**data, "type": "message"}
    return data


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[Annotated[Item, Field()]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    background: bool = False
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _items(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            return {**data, "input": [_default_type(i) for i in data["input"]]}
        return data

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.background:
            raise refused("background", "background responses are not supported; send background: false")
        if isinstance(self.input, list) and not self.input:
            raise refused("input", "input must not be empty")
        return self

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        """The input as items (a string is one user message), reasoning items dropped."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return [i for i in self.input if not isinstance(i, ReasoningItem)]

    def chat_tools(self) -> list[dict] | None:
        return [t.chat_tool() for t in self.tools] if self.tools else None

    def chat_tool_choice(self) -> str | None:
        """``tool_choice`` as ``chat_format.structured`` takes it: a string, or a name (``Named``)."""
        choice = self.tool_choice
        return choice.name if isinstance(choice, NamedFunctionChoice) else choice


def to_messages(items: list, calls: dict[str, str] | None = None) -> list[dict]:
    """``items`` as chat-template messages; ``calls`` maps earlier call ids to their function
    names (a tool message names the function it answers), and learns this input's calls."""
    calls = {} if calls is None else calls
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            calls[item.call_id] = item.name
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            name = calls.get(item.call_id)
            out.append({"role": "tool", "tool_call_id": item.call_id, "name": name, "content": item.text()})
    return [template_message(m) for m in out]


def call_names(messages: list[dict]) -> dict[str, str]:
    """Call id -> function name of every call in ``messages`` (chat-template messages)."""
    return {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ()) if c.get("id")}
