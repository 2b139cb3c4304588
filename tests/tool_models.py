"""Small random-weight models whose chat templates take tools, for the tool-calling tests.

``random:test`` weights (fast on a CPU) with the byte-level tokenizer and a chat template written
here in the style of a family: ``qwen25`` (ChatML, ``<tool_call>`` blocks, tool results as
``<tool_response>`` in a user turn), ``qwen3`` (the same, but the last assistant message gets an
empty think block, as Qwen3's template renders it, so an earlier call is re-rendered differently
once a tool message follows) and ``llama31`` (headers, tools in the first user message, a call as
``{"name", "parameters"}``, tool results as ``ipython``; its special tokens are added to the byte
vocabulary). The templates are written for these tests, following each family's format.
"""

from __future__ import annotations

from dataclasses import replace

from tokenizers import AddedToken

from turnkv.models.load import build_random_model
from turnkv.tokenizer import Tokenizer, byte_level

_QWEN_HEAD = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nFunctions you may call, one signature per line:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nTo call one, answer with\\n<tool_call>\\n{"name": <name>, "arguments": <object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
"""
_QWEN_TAIL = """{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + (fn.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
QWEN25 = _QWEN_HEAD + _QWEN_TAIL
# the last assistant message carries an empty think block (a call's text then starts after it)
QWEN3 = _QWEN_HEAD + "{%- if loop.last %}{{- '\\n<think>\\n\\n</think>\\n' }}{%- endif %}\n" + _QWEN_TAIL

LLAMA31 = """{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}{{- 'Environment: ipython\\n\\n' }}{%- endif %}
{{- system + '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'user' and tools and loop.first %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, respond with a JSON for a function call in the format {"name": function name, "parameters": dictionary of argument name and its value}.\\n\\n' }}
{%- for t in tools %}{{- (t | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}
{{- message.content + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- set fn = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + fn.name + '", "parameters": ' + (fn.arguments | tojson) + '}<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]

TEMPLATES = {"qwen25": QWEN25, "qwen3": QWEN3, "llama31": LLAMA31}


def tool_tokenizer(family: str) -> Tokenizer:
    """The byte-level tokenizer with ``family``'s chat template (and its special tokens)."""
    base = byte_level()
    if family != "llama31":
        return Tokenizer(
            base.backend,
            chat_template=TEMPLATES[family],
            bos_token_id=256,
            eos_token_ids={256, 258},
            add_bos=False,
        )
    backend = base.backend
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLAMA_SPECIALS])
    ids = {s: backend.token_to_id(s) for s in LLAMA_SPECIALS}
    return Tokenizer(
        backend,
        chat_template=LLAMA31,
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_ids={ids["<|eot_id|>"]},
        add_bos=False,
    )


def tool_model(family: str):
    """``random:test`` (fp32, CPU) speaking ``family``'s tool format; its name is ``random:<family>``."""
    loaded = build_random_model("test", "cpu", "float32")
    tok = tool_tokenizer(family)
    config = replace(loaded.config, eos_token_ids=tuple(sorted(tok.eos_token_ids)))
    return replace(loaded, tokenizer=tok, config=config, name=f"random:{family}")
