"""Grammars compiled from a request: a JSON schema, any JSON object, or forced tool calls.

The grammar library is llguidance (chosen by ``bench/grammar_libs.py`` over xgrammar and
outlines-core, docs/BENCHMARKS.md "Structured output"): the cheapest mask per token at a 128K
vocabulary, the fastest compile of a schema, and a schema keyword it does not implement
is an error naming it rather than silently ignored (xgrammar 0.2.9 ignores ``not``, ``if``,
``uniqueItems`` and lets control characters into length-bounded strings); no dependencies.

- ``Grammars`` compiles for one tokenizer and one logit width (thread-safe; the HTTP handlers
  compile in their thread pool, never on the engine thread). A compiled grammar is cached by its
  source, so an agent that resends the same tools every turn compiles them once. A schema is
  checked first (``schema_check``) and a compiled grammar's first steps walked (``grammar_probe``):
  what llguidance would only fail on mid-turn is a ``GrammarError`` before the turn.
- ``Grammar.start()`` gives a turn its ``Matcher`` (the engine's ``masks.Constraint``), built from
  the grammar's text; the step's masks are the engine's (``turnkv.engine.masks``).

JSON is constrained to the layout ``json.dumps`` writes (``", "`` and ``": "``, no newlines):
chat templates re-render a tool call's arguments with ``tojson``, so the banked rows of a tool
call match what the next request renders, and no model can loop on whitespace.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from turnkv.chat_format.grammar_probe import refusal, token_lengths
from turnkv.chat_format.schema_check import DEPTH_MAX
from turnkv.chat_format.schema_check import check as check_schema

if TYPE_CHECKING:
    from turnkv.tokenizer import Tokenizer

# json.dumps's separators, and so tojson's in a chat template; no other whitespace
CANONICAL = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_ENTRIES = 256  # compiled grammars kept, by source

# llguidance's slicer: a mask skips walking the tokens of a slice whose every string the lexer
# allows (inside a JSON string, typically). Its default slices are JSON string runs of 1-10, 1-30
# and any length, so inside a string with ``maxLength`` below 30 every token of 11+ characters is
# walked (most of a 128K vocabulary's trie). Finer steps let shorter bounded strings skip more
# (bench/grammar.py's schema has strings of at most 24 and 40 characters); the masks are the same
# (tests/test_grammar.py), the tokenizer's set-up, once per process, takes longer (figures:
# docs/BENCHMARKS.md "Structured output", finer slices).
_STR = r'[^"\\\x00-\x1F\x7F]'  # a JSON string's characters that need no escape
SLICES = [r"[\x20\x0A\x0D\x09]+", *(f"{_STR}{{1,{n}}}" for n in (2, 4, 8, 10, 16, 30)), _STR + "+"]


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled or enforced; the message says what and where
    (``call``: the index of the ``tool_calls`` shape it is about)."""

    def __init__(self, message: str, call: int | None = None) -> None:
        super().__init__(message)
        self.call = call


@dataclass(frozen=True)
class ToolCallShape:
    """One function a tool-call grammar may emit: ``begin`` (the format's text up to the arguments,
    the name included), the arguments' JSON schema (None: any JSON object), ``end``."""

    begin: str
    parameters: dict | None
    end: str


class Grammar:
    """A compiled grammar; ``start()`` gives a fresh matcher for one turn.

    Each turn's matcher is built anew from the grammar's text rather than ``deep_copy``-ed from
    the compiled one: copies share state that llguidance's thread pool serializes on (figures:
    docs/BENCHMARKS.md "Structured output"); one is built per turn, where ``begin`` runs."""

    def __init__(self, source: str, ll_tokenizer: Any, text: str) -> None:
        self.source = source  # what it was compiled from (the cache key)
        self._ll, self._text = ll_tokenizer, text  # what each turn's matcher is built from

    def start(self) -> Matcher:
        import llguidance

        return Matcher(llguidance.LLMatcher(self._ll, self._text, log_level=0))


class Matcher:
    """One turn's grammar state (an ``engine.masks.Constraint``). ``accept`` advances it by the
    token the turn chose (the token was drawn from a masked row, so a refusal is a bug: it
    raises); ``done`` once the grammar ended (a stop token accepted)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())


class Grammars:
    """Compiles grammars for one tokenizer whose model has ``vocab_size`` logits per row (ids the
    tokenizer does not know, the padding of the logit width, are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._ll: Any = None
        self._lengths: np.ndarray = np.zeros(0)  # of each token, for grammar_probe (with _ll)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()

    def ll_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built once (with each token's length, for
        ``grammar_probe``)."""
        with self._lock:
            if self._ll is None:
                import llguidance

                eos = sorted(self.tokenizer.eos_token_ids)
                self._ll = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos, slices=SLICES
                )
                self._lengths = token_lengths(self._ll, self.vocab_size, set(eos))
            return self._ll

    def _hit(self, key: str) -> Grammar | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _compile(self, key: str, source: str, probes: Sequence[tuple[str, str]] = ()) -> Grammar:
        """The grammar of llguidance ``source`` (cached by ``key``); GrammarError if it is invalid,
        or if its first steps (``grammar_probe``), or those of a ``probes`` grammar (a subschema
        alone, named by its place), fail in llguidance."""
        hit = self._hit(key)
        if hit is not None:
            return hit
        import llguidance

        ll = self.ll_tokenizer()
        matcher = llguidance.LLMatcher(ll, source, log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        problem = refusal(ll, self._lengths, matcher, probes)
        if problem is not None:
            raise GrammarError(problem)
        grammar = Grammar(key, ll, source)  # compiled once to check it
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return grammar

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's ``json_object`` mode)."""
        return self.json_schema({"type": "object"})

    def json_schema(self, schema: dict) -> Grammar:
        """A JSON value valid against ``schema`` (JSON Schema's meaning: a property the schema does
        not forbid may appear). Raises GrammarError naming a keyword it does not implement."""
        import llguidance

        if not isinstance(schema, dict):
            raise GrammarError(f"the schema must be a JSON object (got {type(schema).__name__})")
        try:
            key = "schema:" + json.dumps(schema, sort_keys=True)
        except RecursionError:
            raise GrammarError(f"the schema nests deeper than {DEPTH_MAX} levels") from None
        hit = self._hit(key)
        if hit is not None:
            return hit
        try:
            alone = check_schema(schema)
            source = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=CANONICAL)
            probes = [
                (w, llguidance.LLMatcher.grammar_from_json_schema(s, defaults=CANONICAL)) for w, s in alone
            ]
        except ValueError as e:  # SchemaProblem, or llguidance's
            raise GrammarError(_first_line(str(e))) from None
        return self._compile(key, source, probes)

    def tool_calls(
        self, calls: Sequence[ToolCallShape], separator: str | None = None, max_calls: int = 1
    ) -> Grammar:
        """One to ``max_calls`` calls of ``calls`` (each ``begin + arguments + end``), separated by
        ``separator``, and nothing else: the end of the turn is allowed after every call, and after
        the ``max_calls``-th it is the only token allowed (a model that would repeat a call cannot
        loop to ``max_tokens``). Raises GrammarError."""
        import llguidance

        if max_calls < 1 or (max_calls > 1 and separator is None):
            raise ValueError(f"max_calls {max_calls} needs to be 1, or above 1 with a separator")
        more = f" ({json.dumps(separator)} call){{0,{max_calls - 1}}}" if max_calls > 1 else ""
        lines = ["start: call" + more]
        lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(calls))))
        for i, call in enumerate(calls):
            params = call.parameters if call.parameters is not None else {"type": "object"}
            if not isinstance(params, dict):
                raise GrammarError(f"the parameters of {call.begin!r} must be a JSON object", call=i)
            try:
                self.json_schema(params)  # the schema's own checks and probes (cached by schema)
            except GrammarError as e:
                raise GrammarError(str(e), call=i) from None
            schema = {**params, "x-guidance": CANONICAL}
            lines.append(f"call_{i}: {json.dumps(call.begin)} args_{i} {json.dumps(call.end)}")
            lines.append(f"args_{i}: %json {json.dumps(schema)}")
        lark = "\n".join(lines)
        return self._compile("tools:" + lark, llguidance.LLMatcher.grammar_from_lark(lark))


def _first_line(message: str) -> str:
    """llguidance's error on one line (a regex error spans several), at most 400 characters."""
    return (
        " ".join(line.strip() for line in message.strip().splitlines() if line.strip())[:400]
        or "invalid grammar"
    )
