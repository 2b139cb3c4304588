"""Tool calls in the model's own format: which format a chat template speaks, the grammar shapes
that force a call, and the parser that turns the answer's text into calls (whole or streamed).

A model's chat template renders the tool definitions, the earlier calls and the ``tool``
messages; turnkv passes them through as the OpenAI API sends them (arguments as objects, see
``template_message``). What the model answers is read per family:

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``,
  several separated by a newline, text before them allowed;
- ``llama3_json`` (Llama 3.1/3.2/3.3): the answer is ``{"name": N, "parameters": {...}}``
  (``<|python_tag|>`` before it is a special token, gone from the text), several joined by ``;``.

``ToolCallParser`` is incremental: ``push`` returns content text and call pieces as soon as they
are certain (a call's name once its header is complete, then its arguments as they are
generated), so a stream shows the same calls, in the same pieces' concatenation, as a parse of the
whole answer (``parse`` is ``push`` of everything then ``finish``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import jinja2
from jinja2 import meta
from pydantic_core import from_json  # jiter's parser: the partial mode the anthropic SDK uses

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # what the OpenAI API allows as a function name


class ToolsUnsupported(ValueError):
    """The model's chat template cannot take tools (the message says why and what works)."""


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes a call. ``open``: the text that starts a call anywhere in the answer
    ('' : a call is the whole answer, from its first character); ``header``: the call's text up
    to its arguments, with ``{name}``; ``close``: after the arguments; ``separator`` between two
    calls (None: one call per message, the template cannot render more)."""

    name: str
    open: str
    header: str
    close: str
    separator: str | None
    end: str  # the text that ends a call ('' : a call ends with its JSON object)
    header_re: re.Pattern = field(compare=False, repr=False)


HERMES = ToolFormat(
    "hermes",
    "<tool_call>",
    '<tool_call>\n{{"name": "{name}", "arguments": ',
    "}\n</tool_call>",
    "\n",
    "</tool_call>",
    re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*'),
)
LLAMA3_JSON = ToolFormat(
    "llama3_json",
    "",
    '{{"name": "{name}", "parameters": ',
    "}",
    None,
    "",
    re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*'),
)
FORMATS = {"hermes": HERMES, "llama3_json": LLAMA3_JSON}
FAMILIES = "Qwen2.5, Qwen3 and Hermes (<tool_call>), Llama 3.1-3.3 (JSON)"


def template_format(template: str | None) -> ToolFormat:
    """The tool format of a chat template; ToolsUnsupported when it has none or an unknown one."""
    if not template or "tools" not in meta.find_undeclared_variables(jinja2.Environment().parse(template)):
        raise ToolsUnsupported(
            "this model's chat template has no tool support (it never renders `tools`); "
            f"serve a model whose template does ({FAMILIES}) or describe the tools in a message"
        )
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or '"parameters"' in template:
        return LLAMA3_JSON
    raise ToolsUnsupported(
        f"this model's chat template renders tools in a format turnkv cannot parse (supported: {FAMILIES})"
    )


def template_message(message: dict) -> dict:
    """An OpenAI message as chat templates expect it: a tool call's ``arguments`` as an object
    (templates write them with ``tojson``), keys only when present (``'tool_calls' in message``
    is how Llama 3.1's template tells a call from an answer)."""
    out = {k: v for k, v in message.items() if v is not None and k != "tool_calls"}
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_template_call(c) for c in calls]
    return out


def call_input(arguments: str) -> dict:
    """A call's arguments (the JSON text the model wrote) as an object, the Anthropic API's
    ``input``: text cut by ``max_tokens`` gives the object it spells so far (the complete members;
    jiter's partial mode, the parse the ``anthropic`` SDK's stream builds from the argument
    pieces, so a client that sends the call back sends what the server reported); text that is no
    JSON object is ``{}``."""
    try:
        value = from_json(arguments, allow_partial=True) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _template_call(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str) and json_depth(args) <= ARGUMENTS_DEPTH_MAX:  # deeper: json.loads recurses
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass  # a template that writes a string as is still can
    return {**call, "function": fn}


ARGUMENTS_DEPTH_MAX = 128  # nesting of a call's arguments (deeper: refused, chat_format.structured)
_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')


def json_depth(value: object) -> int:
    """How deep arrays and objects nest in ``value``: a JSON text (its brackets outside strings,
    valid JSON or not) or a parsed value; counted without recursion."""
    if isinstance(value, str):
        depth = deepest = 0
        for m in _BRACKETS.finditer(value):
            c = m.group()
            if c in "[{":
                depth += 1
                deepest = max(deepest, depth)
            elif c in "]}":
                depth -= 1
        return deepest
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


# -- parsing ----------------------------------------------------------------------------------
@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    name: str


@dataclass
class CallArgs:
    index: int
    text: str


Piece = Content | CallStart | CallArgs


@dataclass
class ToolCall:
    name: str
    arguments: str  # the JSON text the model wrote


_TEXT, _HEAD, _ARGS, _TAIL, _DONE = "text", "head", "args", "tail", "done"


class ToolCallParser:
    """Splits an answer into content and calls as it arrives (see the module doc). ``max_calls``:
    calls past it are dropped with everything after them (``parallel_tool_calls: false``)."""

    def __init__(self, fmt: ToolFormat, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self.content = ""
        self._buf = ""  # text not yet decided
        self._state = _TEXT
        self._held = ""  # trailing whitespace of the content: before a call it is a separator
        self._scan = _JsonEnd()
        self._at_start = True  # llama3_json: only the answer's first character can open a call

    def push(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._buf and self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        while self._buf and self._step(out, final=True):
            pass
        if self._state == _HEAD:  # an opened call that never parsed is content after all
            self._content(out, self.fmt.open + self._buf)
        elif self._state == _TEXT:
            self._content(out, self._buf)
        self._buf = ""
        if not self.calls and self._held:
            self._emit(out, self._held)
        self._held = ""
        return out

    def _step(self, out: list[Piece], final: bool) -> bool:
        """Consume what can be decided now; True if the state moved and another step may help."""
        if self._state == _TEXT:
            return self._text(out, final)
        if self._state == _HEAD:
            return self._head(out, final)
        if self._state == _ARGS:
            value, ended, rest = self._scan.feed(self._buf)
            self._args(out, value)
            self._buf = rest
            if ended:
                self._state = _TAIL
            return ended
        if self._state == _TAIL:
            return self._tail(out)
        self._buf = ""  # _DONE: past max_calls
        return False

    def _text(self, out: list[Piece], final: bool) -> bool:
        opener = self.fmt.open
        if not opener:  # llama3_json: a call only from the answer's first non-space character
            stripped = self._buf.lstrip()
            if not self._at_start or (stripped and stripped[0] != "{"):
                self._at_start = False
                self._content(out, self._buf)
                self._buf = ""
                return False
            if stripped:  # "{": a call, or a JSON answer (decided by its header, or at the end)
                self._at_start = False
                self._content(out, self._buf[: len(self._buf) - len(stripped)])
                self._buf = stripped
                self._state = _HEAD
                return True
            return False
        at = self._buf.find(opener)
        if at >= 0:
            self._content(out, self._buf[:at])
            self._buf = self._buf[at + len(opener) :]
            self._state = _HEAD
            return True
        keep = 0 if final else _partial_suffix(self._buf, opener)
        self._content(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _head(self, out: list[Piece], final: bool) -> bool:
        m = self.fmt.header_re.match(self._buf)
        if m:
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                name = m.group(1)
            self._buf = self._buf[m.end() :]
            self._scan = _JsonEnd()
            self._state = _ARGS if self._start(out, name) else _DONE
            return True
        # not the usual header (keys in another order, or no call at all): decided at its end
        end = self._buf.find(self.fmt.end) if self.fmt.end else -1
        if end < 0 and not final:
            return False
        whole = self._buf[:end] if end >= 0 else self._buf
        call = _loads_call(whole.strip())
        if call is None:
            return False  # content: finish() says so (a hermes block that never parses stays held)
        self._buf = self._buf[end + len(self.fmt.end) :] if end >= 0 else ""
        if self._start(out, call[0]):
            self._args(out, call[1])
            self._state = _TEXT if self.fmt.end else _TAIL
        else:
            self._state = _DONE
        return True

    def _tail(self, out: list[Piece]) -> bool:
        """After a call's arguments: its close, then the next call or content."""
        if self.fmt.end:
            at = self._buf.find(self.fmt.end)
            if at < 0:
                return False
            self._buf = self._buf[at + len(self.fmt.end) :]
            self._state = _TEXT
            return True
        rest = self._buf.lstrip()  # llama3_json: "}", then ";" and the next call
        rest = rest[1:].lstrip() if rest.startswith("}") else rest
        rest = rest[1:].lstrip() if rest.startswith(";") else rest
        if not rest:
            self._buf = ""
            return False
        if rest.startswith("{"):
            self._buf = rest
            self._state = _HEAD
            return True
        self._buf = ""
        self._state = _DONE  # anything else after the calls is not part of the answer's format
        return False

    def _start(self, out: list[Piece], name: str) -> bool:
        """A new call named ``name``; False if it is past ``max_calls`` (dropped)."""
        self._held = ""  # the whitespace before a call is the template's separator
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return False
        self.calls.append(ToolCall(name, ""))
        out.append(CallStart(len(self.calls) - 1, name))
        return True

    def _args(self, out: list[Piece], text: str) -> None:
        if text and self._state != _DONE and self.calls:
            self.calls[-1].arguments += text
            out.append(CallArgs(len(self.calls) - 1, text))

    def _content(self, out: list[Piece], text: str) -> None:
        """Content text; trailing whitespace is held until more text follows."""
        body = text.rstrip()
        if body:
            self._emit(out, self._held + body)
            self._held = ""
        self._held += text[len(body) :]

    def _emit(self, out: list[Piece], text: str) -> None:
        self.content += text
        out.append(Content(text))


def parse(fmt: ToolFormat, text: str, max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of a whole answer (what ``ToolCallParser`` streams, at once)."""
    p = ToolCallParser(fmt, max_calls)
    p.push(text)
    p.finish()
    return p.content, p.calls


def _loads_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a call object whose keys are in any order, else None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _JsonEnd:
    """Where one JSON value ends, in text fed piece by piece. ``feed(text)`` returns the value's
    text that is certain now (spaces before the value dropped, spaces after it held), whether
    the value ended (at a ``,`` ``}`` or ``]`` outside it) and the text after the end."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool, str]:
        out: list[str] = []
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif self.depth == 0 and (ch in ",}]" or ch.isspace()):
                if not ch.isspace():
                    return "".join(out), True, text[i:]
                if self.started:
                    self.held += ch
                continue
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
            elif ch == '"':
                self.in_string = True
            self.started = True
            out.append(self.held + ch)
            self.held = ""
        return "".join(out), False, ""
