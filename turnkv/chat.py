"""``turnkv chat``: one conversation across turns, through the same turn path as the server.

Every turn goes through ``engine.turn`` with a private session bank: the turn is admitted,
restored from the bank by its tokens (references, no copy), computed, rebased, sealed and banked.
``/undo`` drops the last exchange from the messages; the next prompt then matches a shorter
prefix of what is banked, so nothing is recomputed. Ctrl-C during an answer stops the answer at
the next token (what was computed is kept: sealed and banked) and returns to the prompt; the
first Ctrl-C only sets the turn's cancel flag (``interruptible``), so no step is cut in the
middle; a second one interrupts (and still cancels the turn). Ctrl-C at the prompt ends the
program. When stdin is not a terminal, every input line is one user message, so the chat can be
scripted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict

from turnkv.bank.session_bank import SessionBank
from turnkv.chat_format.history import ChatHistory
from turnkv.engine.events import Failed, GenEvent, TurnRequest, TurnStats
from turnkv.engine.sampling import SamplingParams
from turnkv.runtime import Runtime

HELP = "commands: /undo (back one turn), /reset, /stats, /quit"


class ChatSession:
    """Messages plus a session bank; forks share the bank (and so every banked row)."""

    def __init__(
        self,
        rt: Runtime,
        params: SamplingParams,
        max_tokens: int | None = 256,  # None: the engine's default (models/generation.py)
        system: str | None = None,
        bank: SessionBank | None = None,
        namespace: str = "chat",
    ) -> None:
        self.rt, self.engine = rt, rt.engine
        self.params = params
        self.max_tokens = max_tokens
        self.bank = bank if bank is not None else rt.bank
        self.namespace = namespace
        self.system = [{"role": "system", "content": system}] if system else []
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = list(self.system)
        self.turns: list[int] = []  # message count before each turn
        self.last: TurnStats | None = None
        self.finish: str | None = None  # the last answer's finish_reason

    def fork(self) -> ChatSession:
        """A second conversation from here (same bank: the shared history is restored, not copied)."""
        other = ChatSession(self.rt, self.params, self.max_tokens, bank=self.bank, namespace=self.namespace)
        other.messages = list(self.messages)
        other.turns = list(self.turns)
        return other

    def ask(self, text: str, cancel: threading.Event | None = None) -> Iterator[str]:
        """Streams the answer's text; the turn is banked when the stream ends (``cancel`` set: the
        answer stops at the next token)."""
        tok = self.engine.tokenizer
        self.turns.append(len(self.messages))
        self.messages.append({"role": "user", "content": text})
        history = list(self.messages)
        request = TurnRequest(
            tok.apply_chat_template(history),
            self.params,
            max_tokens=self.max_tokens,
            namespace=self.namespace,
            render_history=ChatHistory(tok, history),
            cancel=cancel if cancel is not None else threading.Event(),
        )
        pieces = []
        for ev in self.rt.run_turn(request, self.bank, interruptible=True):
            if isinstance(ev, Failed):
                self.turns.pop()
                self.messages.pop()
                raise ValueError(ev.message)
            if isinstance(ev, GenEvent):
                if ev.text:
                    pieces.append(ev.text)
                    yield ev.text
                if ev.finish_reason is not None:
                    self.last, self.finish = ev.stats, ev.finish_reason
        self.messages.append({"role": "assistant", "content": "".join(pieces)})

    def undo(self) -> bool:
        """Back one turn: drop its messages (the bank keeps the rows; nothing is recomputed)."""
        if not self.turns:
            return False
        del self.messages[self.turns.pop() :]
        return True

    def stats(self) -> dict:
        s = self.bank.stats
        out = {
            "turns": len(self.turns),
            "bank_entries": len(self.bank),
            "bank_unique_bytes": self.bank.unique_bytes(live=False),
            "hits": s.hits,
            "misses": s.misses,
        }
        out.update(self.engine.counters())
        if self.last is not None:
            last = asdict(self.last)
            gaps = sorted(last.pop("token_gaps_s"))  # one float per token: summarized, not listed
            if gaps:
                last["token_gap_ms"] = {
                    "p50": round(1000 * gaps[len(gaps) // 2], 2),
                    "p99": round(1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 2),
                    "max": round(1000 * gaps[-1], 2),
                }
            out["last_turn"] = last
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


def run_chat(rt: Runtime, args: argparse.Namespace, params: SamplingParams) -> int:
    engine = rt.engine
    session = ChatSession(rt, params, None, args.system)  # --max-tokens is the engine's default
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"turnkv chat with {engine.info.model_name}. {HELP}", file=sys.stderr)
    try:
        _loop(session, interactive)
    except (EOFError, KeyboardInterrupt):  # Ctrl-C anywhere but inside an answer quits
        pass
    return 0


def _loop(session: ChatSession, interactive: bool) -> None:
    while True:
        line = input("> ") if interactive else sys.stdin.readline()
        if not interactive and not line:
            return
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return
        if line == "/undo":
            print("(undone)" if session.undo() else "(nothing to undo)", flush=True)
        elif line == "/reset":
            session.reset()
            print("(reset)", flush=True)
        elif line == "/stats":
            print(json.dumps(session.stats()), flush=True)
        elif line.startswith("/"):
            print(f"(unknown command; {HELP})", flush=True)
        else:
            with interruptible() as stop:
                for piece in session.ask(line, cancel=stop):
                    print(piece, end="", flush=True)
            print(" (stopped)" if session.finish == "cancelled" else "", flush=True)
