"""The answer structure of a chat-completions or completions body: its fields as the plain values
``chat_format.structured`` takes, and that package's ``ChatFormatError`` as the 400 naming the
field (the one place it is converted).

The checks that read this API's request shape live here, next to the request models: the legacy
``functions`` / ``function_call`` fields, and where an earlier call's arguments sit in
``messages``.
"""

from __future__ import annotations

from turnkv.chat_format.grammar import Grammars
from turnkv.chat_format.structured import (
    ChatFormatError,
    JsonFormat,
    Named,
    Structure,
    ToolChoice,
    chat_structure,
    check_arguments,
    check_tools,
    response_grammar,
)
from turnkv.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    ResponseFormat,
    bad_request,
)

LEGACY = ("functions", "function_call")  # the deprecated form of tools and tool_choice


def request_structure(
    req: ChatCompletionRequest | CompletionRequest, grammars: Grammars, template: str | None
) -> Structure:
    """The grammar and tools ``req`` asks for (``template``: the model's chat template); a 400
    naming the field when they cannot be honoured."""
    try:
        if isinstance(req, ChatCompletionRequest):
            return chat_request_structure(req, grammars, template)
        return Structure(response_grammar(json_format(req.response_format), grammars))
    except ChatFormatError as e:
        raise bad_request(e.message, param=e.param) from None


def chat_request_structure(req: ChatCompletionRequest, grammars: Grammars, template: str | None) -> Structure:
    extra = req.model_extra or {}
    for name in LEGACY:
        if extra.get(name) is not None:
            raise bad_request(f"{name} (deprecated) is not supported; send tools and tool_choice", param=name)
    tools, choice = req.raw_tools(), tool_choice(req)
    check_tools(tools, choice)
    for i, message in enumerate(req.messages):
        for j, call in enumerate(message.tool_calls or ()):
            check_arguments(call.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments")
    return chat_structure(
        grammars, template, json_format(req.response_format), tools, choice, req.parallel_tool_calls
    )


def tool_choice(req: ChatCompletionRequest) -> ToolChoice | None:
    choice = req.tool_choice
    return Named(choice.function.name) if isinstance(choice, NamedToolChoice) else choice


def json_format(rf: ResponseFormat | None) -> JsonFormat | None:
    """A ``response_format`` as a ``JsonFormat`` (None: text)."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return JsonFormat(None, "response_format")
    assert rf.json_schema is not None  # ResponseFormat's validator
    return JsonFormat(rf.json_schema.schema_, "response_format.json_schema.schema")
