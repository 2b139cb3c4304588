"""The answer tokens' logprobs (``engine.logprobs.TokenLogprob``) in the OpenAI response shapes.

Chat: ``choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}]}], "refusal": None}``; a streamed chunk carries the entries of the tokens whose
text it brings (text held back for a stop string brings its tokens' entries with it), so the
chunks' entries join into the whole answer's. Completions: ``{"tokens", "token_logprobs",
"top_logprobs": [{token: logprob}], "text_offset"}``, ``text_offset`` the character offset of the
token's text in the answer. With ``echo`` (the prompt scored, ``TurnRequest.prompt_logprobs``) the
prompt's tokens come first, the first with a null logprob and null alternatives (no row precedes
it), and every offset counts in the returned text: the echoed prompt, then the answer. ``token`` is the token's bytes decoded (a piece of a character reads as
U+FFFD; ``bytes`` has them exactly); a token a grammar masks has ``-inf``, written ``-9999.0`` as
vLLM does (JSON has no infinity).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from turnkv.engine.logprobs import TokenLogprob

FLOOR = -9999.0  # what -inf is written as


@dataclass
class Entry:
    """One answer token's logprob and the offset of its text in the answer (characters)."""

    lp: TokenLogprob
    offset: int
    scored: bool = True  # False: the prompt's first token (no logprob, no alternatives)


class LogprobFormat:
    """Writes ``Entry`` s as chat or completion ``logprobs`` objects for one tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pieces: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token: int) -> tuple[str, list[int]]:
        """A token's text and bytes (memoized: the vocabulary is bounded)."""
        got = self._pieces.get(token)
        if got is None:
            raw = self.tokenizer.token_bytes(token)
            got = self._pieces[token] = (raw.decode("utf-8", "replace"), list(raw))
        return got

    def _item(self, token: int, logprob: float) -> dict:
        text, raw = self.piece(token)
        return {"token": text, "logprob": max(logprob, FLOOR), "bytes": raw}

    def chat(self, entries: list[Entry]) -> dict:
        content = [
            {**self._item(e.lp.token, e.lp.logprob), "top_logprobs": [self._item(t, v) for t, v in e.lp.top]}
            for e in entries
        ]
        return {"content": content, "refusal": None}

    def completion(self, entries: list[Entry]) -> dict:
        return {
            "tokens": [self.piece(e.lp.token)[0] for e in entries],
            "token_logprobs": [max(e.lp.logprob, FLOOR) if e.scored else None for e in entries],
            "top_logprobs": [
                {self.piece(t)[0]: max(v, FLOOR) for t, v in e.lp.top} if e.scored else None for e in entries
            ],
            "text_offset": [e.offset for e in entries],
        }


@dataclass
class Collector:
    """The entries of a turn's events as they come (``add``), taken in chunks (``take``)."""

    fmt: LogprobFormat
    chat: bool
    entries: list[Entry] = field(default_factory=list)
    _offset: int = 0  # characters of answer text before the next event's
    _taken: int = 0

    def add(self, lp: TokenLogprob | None, text: str) -> None:
        """One answer event: its token's logprob (None: none, an end-of-sequence token's) and text."""
        if lp is not None:
            self.entries.append(Entry(lp, self._offset))
        self._offset += len(text)

    def prompt(self, first: int, scored: list[TokenLogprob], echoed: str) -> None:
        """The prompt's entries before the answer's: ``first`` its first token (unscored), then
        ``scored`` (tokens 1..P-1); the answer's offsets then start after the ``echoed`` text."""
        self.entries.append(Entry(TokenLogprob(first, 0.0), 0, scored=False))
        offset = len(self.fmt.piece(first)[0])
        for lp in scored:
            self.entries.append(Entry(lp, offset))
            offset += len(self.fmt.piece(lp.token)[0])
        self._offset = len(echoed)

    def take(self) -> dict | None:
        """The entries not taken yet as a ``logprobs`` object (None when there are none)."""
        new, self._taken = self.entries[self._taken :], len(self.entries)
        return self.whole(new) if new else None

    def whole(self, entries: list[Entry] | None = None) -> dict:
        entries = self.entries if entries is None else entries
        return self.fmt.chat(entries) if self.chat else self.fmt.completion(entries)
