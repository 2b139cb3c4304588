"""What a request asks of the answer's shape: the grammar that constrains it, and how its text is
read back as tool calls. Runs in the handler's thread pool, where a schema is compiled (its cost:
docs/BENCHMARKS.md "Structured output"; a repeated one is a cache hit).

- a JSON answer (``JsonFormat``; ``response_format`` ``json_object`` / ``json_schema``): a JSON
  grammar (``grammar``).
- ``tools``: rendered by the model's chat template; its format (``toolcalls.template_format``)
  says how calls look. The tool choice ``auto`` (the default): the answer is parsed, plain content
  when the model calls nothing; ``required``: a grammar forces one call of the tools (up to
  ``FORCED_CALLS_MAX`` with parallel calls), a named function (``Named``): exactly one call of it
  (parallel calls aside: the client named the call it wants), arguments valid for their schema,
  so the calls always parse, and the turn ends after them; ``none``: tools are rendered (the
  prompt stays the same as on turns that allow calls, so it stays cached) and nothing is parsed.

Nothing here knows an API's request shape: callers pass plain values (the tools as the template
renders them, a ``ToolChoice``, a ``JsonFormat``) and every problem is a ``ChatFormatError``
naming the field (``param``), decided before the turn runs: a schema is checked and its
grammar's first steps walked when it is compiled (``grammar``), and an earlier call's arguments
may nest at most ``ARGUMENTS_DEPTH_MAX`` deep (``check_arguments``). The server answers it as a
400 (``server.structured``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from turnkv.chat_format.grammar import Grammar, GrammarError, Grammars, ToolCallShape
from turnkv.chat_format.toolcalls import (
    ARGUMENTS_DEPTH_MAX,
    ToolFormat,
    ToolsUnsupported,
    json_depth,
    template_format,
)

# the most calls a forced ``required`` turn may write with parallel calls: a model that repeats its
# call ends the turn there instead of at max_tokens
FORCED_CALLS_MAX = 16


class ChatFormatError(ValueError):
    """A request's answer structure cannot be honoured: ``message`` for the client, ``param`` the
    path of the field at fault (``tools[0].function.parameters``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Named:
    """A tool choice naming one function: exactly one call of it."""

    name: str


ToolChoice = Literal["none", "auto", "required"] | Named


@dataclass(frozen=True)
class JsonFormat:
    """An answer that must be JSON: any object (``schema`` None or True) or one valid for ``schema``
    (a JSON schema as the client sent it); ``param`` is the field that carries it, for errors."""

    schema: dict | bool | None
    param: str


@dataclass(frozen=True)
class ToolPlan:
    """How the answer is read: calls in ``fmt``, at most ``max_calls`` of them (None: any);
    ``calls_as_input``: the API reports a call's arguments as an object (``ChatHistory``'s)."""

    fmt: ToolFormat
    max_calls: int | None
    calls_as_input: bool = False


@dataclass(frozen=True)
class Structure:
    grammar: Grammar | None = None
    tools: list[dict] | None = None  # what the chat template renders
    plan: ToolPlan | None = None  # None: the answer is content, never parsed


def response_grammar(fmt: JsonFormat | None, grammars: Grammars) -> Grammar | None:
    """The grammar of a JSON answer (None: text); a schema it cannot enforce is an error."""
    if fmt is None:
        return None
    try:
        if fmt.schema is None or fmt.schema is True:
            return grammars.json_object()
        if not isinstance(fmt.schema, dict):
            # named by its path below the request's field, as the client wrote it: json_schema.schema
            raise GrammarError(f"{fmt.param.split('.', 1)[-1]} must be a JSON object")
        return grammars.json_schema(fmt.schema)
    except GrammarError as e:
        raise ChatFormatError(f"{fmt.param}: the schema cannot be enforced: {e}", fmt.param) from None


def check_tools(tools: list[dict] | None, choice: ToolChoice | None) -> None:
    """The checks of the tools and the tool choice that span both."""
    names = [t["function"]["name"] for t in tools or ()]
    if len(set(names)) != len(names):
        raise ChatFormatError("function names must be unique", "tools")
    if isinstance(choice, Named) and choice.name not in names:
        raise ChatFormatError(
            f"tool_choice names {choice.name[:80]!r}, which is not one of the tools", "tool_choice"
        )
    if choice == "required" and not names:
        raise ChatFormatError('tool_choice "required" needs tools', "tool_choice")


def check_arguments(arguments: str | dict, param: str) -> None:
    """An earlier call's ``arguments`` (a text or an object; a text that is not JSON reaches the
    template as the text) nest at most ``ARGUMENTS_DEPTH_MAX`` deep; ``param`` names where they are."""
    depth = json_depth(arguments)
    if depth > ARGUMENTS_DEPTH_MAX:
        raise ChatFormatError(
            f"{param}: the arguments nest {depth} levels deep; at most {ARGUMENTS_DEPTH_MAX}", param
        )


def chat_structure(
    grammars: Grammars,
    template: str | None,
    answer: JsonFormat | None,
    tools: list[dict] | None,
    choice: ToolChoice | None,
    parallel: bool,
) -> Structure:
    """The structure of a chat turn: ``tools`` as the template renders them (``{"type": "function",
    "function": {"name", "parameters", ...}}``; checked by ``check_tools``), ``choice`` (None:
    ``auto``), ``parallel``: whether the client allows several calls in one answer."""
    grammar = response_grammar(answer, grammars)
    if not tools:
        return Structure(grammar)
    try:
        fmt = template_format(template)
    except ToolsUnsupported as e:
        raise ChatFormatError(f"tools: {e}", "tools") from None
    choice = choice or "auto"
    if choice == "none":
        return Structure(grammar, tools)
    parallel = parallel and fmt.separator is not None
    if choice == "auto":
        return Structure(grammar, tools, ToolPlan(fmt, None if parallel else 1))
    named = choice.name if isinstance(choice, Named) else None
    most = FORCED_CALLS_MAX if parallel and named is None else 1  # a named function: one call
    if grammar is not None:
        raise ChatFormatError(
            "response_format and a forced tool call (tool_choice required or a function) cannot both "
            "be enforced; send one of them",
            "tool_choice",
        )
    wanted = [k for k, t in enumerate(tools) if named is None or t["function"]["name"] == named]
    shapes = [
        ToolCallShape(fmt.header.format(name=f["name"]), f.get("parameters") or None, fmt.close)
        for f in (tools[k]["function"] for k in wanted)
    ]
    try:
        grammar = grammars.tool_calls(shapes, fmt.separator, most)
    except GrammarError as e:
        where = "tools" if e.call is None else f"tools[{wanted[e.call]}].function.parameters"
        raise ChatFormatError(f"{where}: the parameters cannot be enforced: {e}", where) from None
    return Structure(grammar, tools, ToolPlan(fmt, most))
