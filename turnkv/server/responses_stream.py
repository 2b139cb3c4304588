"""The Responses API's output: the answer's items and the stream events the OpenAI SDK parses.

``Output`` reads the answer's text (through the tool-call parser when tools may be called) into
output items, a ``message`` with one ``output_text`` part and a ``function_call`` per call, and
yields the events that build them, in the order the OpenAI API sends them::

    response.output_item.added      (a message, content [])
    response.content_part.added     (output_text, text "")
    response.output_text.delta ...
    response.output_text.done / response.content_part.done / response.output_item.done
    response.output_item.added      (a function_call, arguments "")
    response.function_call_arguments.delta ... / .done, response.output_item.done

A whole (non-stream) body is built by the same ``Output``, its events dropped, so both carry the
same items. ``sse`` writes one event (``event:`` and ``data:`` lines); ``sequence_number`` counts
every event of a stream from 0, as the API numbers them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from turnkv.bank.breaks import CacheBreak
from turnkv.chat_format.structured import ToolPlan
from turnkv.chat_format.toolcalls import CallArgs, CallStart, Content, ToolCallParser
from turnkv.server.responses import break_body


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Open:
    """The item being written: its index in ``output`` and its text so far."""

    index: int
    item: dict
    text: str = ""


@dataclass
class Output:
    """The output items of one answer, built from its text pieces (``push``, then ``finish``)."""

    plan: ToolPlan | None
    items: list[dict] = field(default_factory=list)
    _open: _Open | None = None

    def __post_init__(self) -> None:
        self.parser = ToolCallParser(self.plan.fmt, self.plan.max_calls) if self.plan is not None else None

    def push(self, text: str, last: bool = False) -> list[dict]:
        """The events of one more piece of answer text (``last``: the answer's end)."""
        if self.parser is None:
            found = [Content(text)] if text else []
        else:
            found = self.parser.push(text) + (self.parser.finish() if last else [])
        events: list[dict] = []
        for piece in found:
            if isinstance(piece, Content):
                events += self._text(piece.text)
            elif isinstance(piece, CallStart):
                events += self._close()
                events += self._start_call(piece.name)
            elif isinstance(piece, CallArgs):
                assert self._open is not None
                self._open.text += piece.text
                events.append(self._on_item("response.function_call_arguments.delta", delta=piece.text))
        if last:
            if not self.items and self._open is None:
                events += self._start_message()  # an empty answer is still one message
            events += self._close()
        return events

    def text(self) -> str:
        """The answer's content (the messages' text), as ``output_text`` reads it."""
        return "".join(c["text"] for i in self.items if i["type"] == "message" for c in i["content"])

    def calls(self) -> list[dict]:
        return [i for i in self.items if i["type"] == "function_call"]

    # -- items --------------------------------------------------------------------------------
    def _on_item(self, type_: str, **fields) -> dict:
        assert self._open is not None
        return {"type": type_, "item_id": self._open.item["id"], "output_index": self._open.index, **fields}

    def _added(self, item: dict) -> dict:
        self._open = _Open(len(self.items), item)
        self.items.append(item)
        return {"type": "response.output_item.added", "output_index": self._open.index, "item": dict(item)}

    def _start_message(self) -> list[dict]:
        item = {
            "id": new_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._added(item), self._on_item("response.content_part.added", content_index=0, part=part)]

    def _start_call(self, name: str) -> list[dict]:
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": new_id("call"),
            "name": name,
            "arguments": "",
        }
        return [self._added(item)]

    def _text(self, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open.item["type"] != "message":
            events += self._close() + self._start_message()
        assert self._open is not None
        self._open.text += text
        events.append(self._on_item("response.output_text.delta", content_index=0, delta=text, logprobs=[]))
        return events

    def _close(self) -> list[dict]:
        op = self._open
        if op is None:
            return []
        events = []
        if op.item["type"] == "message":
            part = {"type": "output_text", "text": op.text, "annotations": [], "logprobs": []}
            op.item.update(content=[part], status="completed")
            events += [
                self._on_item("response.output_text.done", content_index=0, text=op.text, logprobs=[]),
                self._on_item("response.content_part.done", content_index=0, part=dict(part)),
            ]
        else:
            op.item.update(arguments=op.text, status="completed")
            events.append(
                self._on_item(
                    "response.function_call_arguments.done", name=op.item["name"], arguments=op.text
                )
            )
        events.append({"type": "response.output_item.done", "output_index": op.index, "item": dict(op.item)})
        self._open = None
        return events


class EventNumbers:
    """Numbers a stream's events and writes them as SSE."""

    def __init__(self) -> None:
        self.n = 0

    def sse(self, event: dict) -> str:
        event = {**event, "sequence_number": self.n}
        self.n += 1
        data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
        return f"event: {event['type']}\ndata: {data}\n\n"


def usage(prompt: int, cached: int, completion: int, brk: CacheBreak | None = None) -> dict:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
        "cache_break": break_body(brk),
    }


def finished(response: dict, output: Output, finish: str | None, use: dict) -> dict:
    """``response`` once the answer ended with ``finish`` (``length``: incomplete)."""
    incomplete = finish == "length"
    return {
        **response,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": output.items,
        "usage": use,
    }


__all__ = ["EventNumbers", "Output", "finished", "new_id", "usage"]
