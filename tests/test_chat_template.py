"""``--chat-template``: a file or a shipped template replaces the model's own, for every route.

The shipped ``chatml-tools`` gives ChatML models whose own template renders no tools (the default
model) Hermes-style ``<tool_call>`` blocks, so tool calling and agent loops run on the default
model. A bad template is a one-line error before the model loads.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from turnkv.chat_format.toolcalls import template_format
from turnkv.config import ConfigError, EngineConfig
from turnkv.runtime import chat_template, load_engine
from turnkv.tokenizer import byte_level, chat_template_text

TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


def test_shipped_template_renders_hermes_tool_calls():
    text = chat_template_text("chatml-tools")
    assert template_format(text).name == "hermes"
    tok = byte_level().with_chat_template(text)
    call = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Read a.py"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
    ]
    out = tok.render_chat(messages, tools=[TOOL])
    assert out.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOL) in out
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>' in out
    assert "<|im_start|>user\n<tool_response>\nprint(1)\n</tool_response><|im_end|>\n" in out
    assert out.endswith("<|im_start|>assistant\n")


def test_the_loaded_tokenizer_keeps_its_own_template():
    tok = byte_level()
    other = tok.with_chat_template("{{ messages[0].content }}")
    assert other.render_chat([{"role": "user", "content": "x"}], add_generation_prompt=False) == "x"
    assert tok.chat_template != other.chat_template


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("no-such-template", "neither a file nor a shipped template (chatml-tools"),
        ("{bad}", "neither a file"),
    ],
)
def test_unknown_template_names_what_exists(spec, needle):
    with pytest.raises(ConfigError, match=r"chat_template") as exc:
        chat_template(spec)
    assert needle in str(exc.value)


def test_a_template_that_does_not_compile_fails_before_the_load(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="does not compile as a Jinja template"):
        load_engine(EngineConfig(model="default", chat_template=str(bad), device="cpu"), progress=False)


def test_a_template_file_is_used(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    engine = load_engine(
        replace(EngineConfig(device="cpu"), model="random:test", chat_template=str(path)), progress=False
    )
    assert engine.tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi\n"


@pytest.mark.slow
def test_default_model_calls_tools_and_the_next_turn_reuses_the_call(default_model):
    """Served with ``chatml-tools``: a forced call parses, and the follow-up with the tool's result
    restores the prompt and the call from the bank (only the result is prefilled)."""
    from test_server import Live

    live = Live(default_model, chat_template="chatml-tools")
    try:
        client = live.client()
        messages = [{"role": "user", "content": "Read the file a.py"}]
        first = client.chat.completions.create(
            model="default",
            messages=messages,
            tools=[TOOL],
            tool_choice="required",
            max_tokens=96,
            temperature=0,
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert call.function.name == "read_file"
        json.loads(call.function.arguments)
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "print('hello')"},
        ]
        live.idle()
        second = client.chat.completions.create(
            model="default", messages=messages, tools=[TOOL], max_tokens=8, temperature=0
        )
        history = first.usage.prompt_tokens + first.usage.completion_tokens
        assert second.usage.prompt_tokens_details.cached_tokens >= history - 1  # the call's end token
    finally:
        live.close()
