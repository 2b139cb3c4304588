"""What a request asks of the answer's shape: the grammar that constrains it, and how its text is
read back as tool calls. Runs in the handler's thread pool, where a schema is compiled (its cost:
docs/BENCHMARKS.md "Structured output"; a repeated one is a cache hit).

- ``response_format`` ``json_object`` / ``json_schema``: a JSON grammar (``grammar``).
- ``tools``: rendered by the model's chat template; its format (``toolcalls.template_format``)
  says how calls look. ``tool_choice`` ``auto`` (the default): the answer is parsed, plain content
  when the model calls nothing; ``required``: a grammar forces one call of the tools (up to
  ``FORCED_CALLS_MAX`` with ``parallel_tool_calls``), a named function: exactly one call of it
  (``parallel_tool_calls`` aside: the client named the call it wants), arguments valid for
  their schema, so the calls always parse, and the turn ends after them; ``none``: tools are
  rendered (the prompt stays the same as on turns that allow calls, so it stays cached) and
  nothing is parsed.

Every problem is an ``ApiError`` 400 naming its field, decided here, before the turn runs: a schema
is checked and its grammar's first steps walked when it is compiled (``grammar``), and the
history's tool-call arguments may nest at most ``ARGUMENTS_DEPTH_MAX`` deep (``check_history``).
"""

from __future__ import annotations

from dataclasses import dataclass

from turnkv.chat_format.grammar import Grammar, GrammarError, Grammars, ToolCallShape
from turnkv.chat_format.toolcalls import (
    ARGUMENTS_DEPTH_MAX,
    ToolFormat,
    ToolsUnsupported,
    json_depth,
    template_format,
)
from turnkv.server.schemas import ChatCompletionRequest, NamedToolChoice, ResponseFormat, bad_request

# the most calls a forced ``required`` turn may write with ``parallel_tool_calls``: a model that
# repeats its call ends the turn there instead of at max_tokens
FORCED_CALLS_MAX = 16


@dataclass(frozen=True)
class ToolPlan:
    """How the answer is read: calls in ``fmt``, at most ``max_calls`` of them (None: any)."""

    fmt: ToolFormat
    max_calls: int | None


@dataclass(frozen=True)
class Structure:
    grammar: Grammar | None = None
    tools: list[dict] | None = None  # what the chat template renders
    plan: ToolPlan | None = None  # None: the answer is content, never parsed


def response_grammar(rf: ResponseFormat | None, grammars: Grammars) -> Grammar | None:
    """The grammar of a ``response_format`` (None for text); a schema it cannot enforce is a 400."""
    if rf is None or rf.type == "text":
        return None
    try:
        if rf.type == "json_object":
            return grammars.json_object()
        assert rf.json_schema is not None
        schema = rf.json_schema.schema_
        if schema is True:
            return grammars.json_object()
        if not isinstance(schema, dict):
            raise GrammarError("json_schema.schema must be a JSON object")
        return grammars.json_schema(schema)
    except GrammarError as e:
        where = "response_format" if rf.type == "json_object" else "response_format.json_schema.schema"
        raise bad_request(f"{where}: the schema cannot be enforced: {e}", param=where) from None


LEGACY = ("functions", "function_call")  # the deprecated form of tools and tool_choice


def check_tools(req: ChatCompletionRequest) -> None:
    """The checks of ``tools`` and ``tool_choice`` that span fields (400 naming the field)."""
    extra = req.model_extra or {}
    for name in LEGACY:
        if extra.get(name) is not None:
            raise bad_request(f"{name} (deprecated) is not supported; send tools and tool_choice", param=name)
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise bad_request("function names must be unique", param="tools")
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise bad_request(
            f"tool_choice names {choice.function.name[:80]!r}, which is not one of the tools",
            param="tool_choice",
        )
    if choice == "required" and not names:
        raise bad_request('tool_choice "required" needs tools', param="tool_choice")


def check_history(req: ChatCompletionRequest) -> None:
    """The earlier calls' ``arguments`` nest at most ``ARGUMENTS_DEPTH_MAX`` deep (a text or an
    object; a text that is not JSON reaches the template as the text)."""
    for i, message in enumerate(req.messages):
        for j, call in enumerate(message.tool_calls or ()):
            depth = json_depth(call.function.arguments)
            if depth > ARGUMENTS_DEPTH_MAX:
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                raise bad_request(
                    f"{where}: the arguments nest {depth} levels deep; at most {ARGUMENTS_DEPTH_MAX}",
                    param=where,
                )


def chat_structure(req: ChatCompletionRequest, grammars: Grammars, template: str | None) -> Structure:
    check_tools(req)
    check_history(req)
    grammar = response_grammar(req.response_format, grammars)
    tools = req.raw_tools()
    if not tools:
        return Structure(grammar)
    try:
        fmt = template_format(template)
    except ToolsUnsupported as e:
        raise bad_request(f"tools: {e}", param="tools") from None
    choice = req.tool_choice or "auto"
    if choice == "none":
        return Structure(grammar, tools)
    parallel = req.parallel_tool_calls and fmt.separator is not None
    if choice == "auto":
        return Structure(grammar, tools, ToolPlan(fmt, None if parallel else 1))
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    most = FORCED_CALLS_MAX if parallel and named is None else 1  # a named function: one call
    if grammar is not None:
        raise bad_request(
            "response_format and a forced tool call (tool_choice required or a function) cannot both "
            "be enforced; send one of them",
            param="tool_choice",
        )
    assert req.tools is not None
    wanted = [k for k, t in enumerate(req.tools) if named is None or t.function.name == named]
    shapes = [
        ToolCallShape(fmt.header.format(name=t.function.name), t.function.parameters or None, fmt.close)
        for t in (req.tools[k] for k in wanted)
    ]
    try:
        grammar = grammars.tool_calls(shapes, fmt.separator, most)
    except GrammarError as e:
        where = "tools" if e.call is None else f"tools[{wanted[e.call]}].function.parameters"
        raise bad_request(f"{where}: the parameters cannot be enforced: {e}", param=where) from None
    return Structure(grammar, tools, ToolPlan(fmt, most))
