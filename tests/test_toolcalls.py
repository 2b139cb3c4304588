"""Reading tool calls (turnkv/chat_format/toolcalls.py): the parser against the format's own
rendering, a stream cut anywhere equals the whole answer, template detection, messages as templates
take them. No model: fast."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_models import LLAMA31, QWEN3, QWEN25

from turnkv.chat_format.toolcalls import (
    HERMES,
    LLAMA3_JSON,
    CallArgs,
    CallStart,
    Content,
    ToolCallParser,
    ToolsUnsupported,
    parse,
    template_format,
    template_message,
)
from turnkv.tokenizer import CHATML_TEMPLATE

names = st.from_regex(r"[a-zA-Z0-9_-]{1,12}", fullmatch=True)
scalars = st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=6), values, max_size=4)
calls = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)


def render(fmt, content: str, cs: list) -> str:
    """An answer as the model writes it in ``fmt`` (the separators of the format's own template)."""
    texts = [fmt.header.format(name=n) + json.dumps(a, ensure_ascii=False) + fmt.close for n, a in cs]
    if fmt is HERMES:
        return (content + "\n" if content else "") + "\n".join(texts)
    return "; ".join(texts)


def stream(fmt, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], list]:
    """Feed ``text`` cut at ``cuts``: the content, the calls and the pieces, as a stream gets them."""
    p = ToolCallParser(fmt)
    pieces, last = [], 0
    for c in [*sorted(cuts), len(text)]:
        pieces += p.push(text[last:c])
        last = c
    pieces += p.finish()
    return p.content, [(c.name, c.arguments) for c in p.calls], pieces


def reassemble(pieces: list) -> tuple[str, list[tuple[str, str]]]:
    """What a client rebuilds from the pieces (content joined; arguments joined by call index)."""
    content, out = "", {}
    for piece in pieces:
        if isinstance(piece, Content):
            content += piece.text
        elif isinstance(piece, CallStart):
            out[piece.index] = [piece.name, ""]
        else:
            assert isinstance(piece, CallArgs)
            out[piece.index][1] += piece.text
    return content, [tuple(out[i]) for i in sorted(out)]


@settings(max_examples=60, deadline=None)
@given(
    cs=calls,
    content=st.sampled_from(["", "Let me look.", "Sure: here"]),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_a_rendered_answer_parses_back_whole_and_cut_anywhere(cs, content, cuts):
    for fmt in (HERMES, LLAMA3_JSON):
        text = render(fmt, content if fmt is HERMES else "", cs)
        want = [(n, json.dumps(a, ensure_ascii=False)) for n, a in cs]
        got_content, got_calls = parse(fmt, text)
        assert [(c.name, c.arguments) for c in got_calls] == want
        assert got_content == (content if fmt is HERMES else "")
        s_content, s_calls, pieces = stream(fmt, text, [c for c in cuts if c <= len(text)])
        assert (s_content, s_calls) == (got_content, want)
        assert reassemble(pieces) == (got_content, want)  # the deltas join into the same calls


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=60), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_an_answer_without_calls_is_its_own_content(text, cuts):
    if "<tool_call>" not in text:
        assert parse(HERMES, text) == (text, [])
        assert stream(HERMES, text, [c for c in cuts if c <= len(text)])[:2] == (text, [])
    if not text.lstrip().startswith("{"):
        assert parse(LLAMA3_JSON, text) == (text, [])


def test_calls_in_other_shapes_still_parse_and_broken_ones_stay_content():
    swapped = '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>'
    assert [(c.name, c.arguments) for c in parse(HERMES, swapped)[1]] == [("f", '{"x": 1}')]
    broken = "<tool_call>\nnot json\n</tool_call>"
    assert parse(HERMES, broken) == (broken, [])
    assert [c.name for c in parse(LLAMA3_JSON, ' {"name": "g", "arguments": {}}')[1]] == ["g"]
    assert parse(LLAMA3_JSON, '{"answer": 42}') == ('{"answer": 42}', [])
    # parallel_tool_calls false: one call, the rest dropped
    two = render(HERMES, "", [("a", {}), ("b", {"y": 2})])
    assert [c.name for c in parse(HERMES, two, max_calls=1)[1]] == ["a"]


def test_template_formats():
    assert template_format(QWEN25) is HERMES and template_format(QWEN3) is HERMES
    assert template_format(LLAMA31) is LLAMA3_JSON
    with pytest.raises(ToolsUnsupported, match="no tool support"):
        template_format(CHATML_TEMPLATE)  # what the default SmolLM2 model's template is like
    with pytest.raises(ToolsUnsupported, match="cannot parse"):
        template_format("{% for t in tools %}{{ t.name }}{% endfor %}")


def test_messages_reach_the_template_with_arguments_as_objects():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, 2]}'}}
    msg = template_message({"role": "assistant", "content": "", "tool_calls": [call], "name": None})
    assert msg == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**call, "function": {"name": "f", "arguments": {"a": [1, 2]}}}],
    }
    assert "tool_calls" not in template_message({"role": "assistant", "content": "hi", "tool_calls": []})
