"""``turnkv chat``: one conversation across turns, kept in one live KV cache.

Each finished turn is sealed, so ``/undo`` is a trim back to the row count before the last turn:
the earlier turns' segments are still there and nothing is recomputed. When stdin is not a
terminal, every input line is one user message, so the chat can be scripted.

Ctrl-C (SIGINT) during an answer stops it at the next token: the text so far becomes the
assistant's message and its rows are sealed into the conversation, and the prompt comes back. A
second Ctrl-C before the answer has stopped (a long prefill), or Ctrl-C at the prompt, ends the
program as before.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict

from turnkv.engine.engine import Engine, TurnStats
from turnkv.engine.sampling import SamplingParams

HELP = "commands: /undo (back one turn), /reset, /stats, /quit"


class ChatSession:
    """Messages plus the live cache; ``turns`` remembers (message count, cached rows) before each turn."""

    def __init__(self, engine: Engine, params: SamplingParams, system: str | None = None) -> None:
        self.engine = engine
        self.params = params
        self.system = [{"role": "system", "content": system}] if system else []
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = list(self.system)
        self.cache = self.engine.new_cache()
        self.turns: list[tuple[int, int]] = []
        self.last: TurnStats | None = None

    def ask(self, text: str, should_stop: Callable[[], bool] | None = None) -> Iterator[str]:
        """Streams the answer's text; the turn is sealed when the stream ends (``should_stop``
        ends it early, keeping what was generated)."""
        self.turns.append((len(self.messages), self.cache.num_tokens))
        self.messages.append({"role": "user", "content": text})
        ids = self.engine.tokenizer.apply_chat_template(self.messages)
        pieces = []
        for ev in self.engine.generate(self.cache, ids, self.params, should_stop=should_stop):
            if ev.text:
                pieces.append(ev.text)
                yield ev.text
            if ev.stats is not None:
                self.last = ev.stats
        self.messages.append({"role": "assistant", "content": "".join(pieces)})
        self.cache.seal()

    def undo(self) -> bool:
        """Back one turn: drop its messages and trim the cache to its start (no copy, no recompute)."""
        if not self.turns:
            return False
        n_messages, rows = self.turns.pop()
        del self.messages[n_messages:]
        self.cache.trim(rows)
        return True

    def stats(self) -> dict:
        out = {
            "turns": len(self.turns),
            "cached_rows": self.cache.num_tokens,
            "segments": len(self.cache.views(0)),
        }
        out.update(self.engine.counters())
        if self.last is not None:
            out["last_turn"] = asdict(self.last)
        return out


@contextlib.contextmanager
def interruptible() -> Iterator[threading.Event]:
    """While inside, the first SIGINT sets the yielded event instead of raising KeyboardInterrupt;
    a second one raises as usual. Only in the main thread (signals cannot be caught elsewhere)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_sigint(signum, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def run_chat(engine: Engine, args: argparse.Namespace, params: SamplingParams) -> int:
    session = ChatSession(engine, params, args.system)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"turnkv chat with {engine.model_name}. {HELP}", file=sys.stderr)
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            break
        if line == "/undo":
            print("(undone)" if session.undo() else "(nothing to undo)", flush=True)
        elif line == "/reset":
            session.reset()
            print("(reset)", flush=True)
        elif line == "/stats":
            import json

            print(json.dumps(session.stats()), flush=True)
        elif line.startswith("/"):
            print(f"(unknown command; {HELP})", flush=True)
        else:
            with interruptible() as stop:
                for piece in session.ask(line, should_stop=stop.is_set):
                    print(piece, end="", flush=True)
            print(" (stopped)" if stop.is_set() else "", flush=True)
    return 0
