"""Constrained decoding: compiled grammars, one matcher per turn, the masks of a step.

The grammar library is llguidance (chosen by ``bench/grammar_libs.py`` over xgrammar and
outlines-core, figures in docs/BENCHMARKS.md): the cheapest mask per token at a 128K vocabulary
(15-18 us against xgrammar's 26-40 and outlines-core's 90), within 3 us of xgrammar's at the
default model's 49152 tokens (where applying the mask costs ~100 us either way), a schema compiled
in ~1 ms (xgrammar: 6-30 ms, outlines-core: 0.1-0.7 s), and a schema keyword it does not implement
is an error naming it rather than silently ignored (xgrammar 0.2.9 ignores ``not``, ``if``,
``uniqueItems`` and lets control characters into length-bounded strings); no dependencies.

- ``Grammars`` compiles for one tokenizer and one logit width (thread-safe; the HTTP handlers
  compile in their thread pool, never on the engine thread). A compiled grammar is cached by its
  source, so an agent that resends the same tools every turn compiles them once. A schema is
  checked first (``schema_check``) and a compiled grammar's first steps walked (``grammar_probe``):
  what llguidance would only fail on mid-turn is a ``GrammarError`` before the turn.
- ``Grammar.start()`` gives a turn its ``Constraint`` (a matcher built from the grammar's text).
- ``StepMasks.apply`` runs once per step, after the forward is launched and before the step's
  batched argmax: it fills the bitmask of every constrained row on the host (on CUDA this overlaps
  the forward; several rows are filled by llguidance's threads) and applies them to those rows of
  the step's logits in one batched op (on CUDA one Triton launch, ``mask_kernel.py``), so the
  batched argmax and every sampler see masked rows. Unconstrained rows are not touched.
- ``StepMasks.start`` fills them ahead: once a step's tokens are back, the constrained turns give
  theirs to their grammars first (``Turn.take_early``) and the next step's masks are filled on a
  thread while the turns do the rest of their host work (text, stop strings, events); ``apply``
  then only waits for what is left of it. H200, batch 32, 128K vocabulary: the fill's wait on the
  critical path 2.98 -> 1.72 ms a step, the grammar's cost over free decoding 23.0 -> 18.6 %
  (docs/BENCHMARKS.md). An earlier background fill was slower (7.25 against 7.07 ms a step): its
  thread had to win the GIL from the engine thread's Python (up to the 5 ms switch interval) to
  start and to finish; ``start`` now waits until the thread is inside llguidance, which runs
  without the GIL.

JSON is constrained to the layout ``json.dumps`` writes (``", "`` and ``": "``, no newlines):
chat templates re-render a tool call's arguments with ``tojson``, so the banked rows of a tool
call match what the next request renders, and no model can loop on whitespace.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from turnkv.engine.grammar_probe import refusal, token_lengths
from turnkv.engine.schema_check import DEPTH_MAX
from turnkv.engine.schema_check import check as check_schema

if TYPE_CHECKING:
    from turnkv.tokenizer import Tokenizer

# json.dumps's separators, and so tojson's in a chat template; no other whitespace
CANONICAL = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_ENTRIES = 256  # compiled grammars kept, by source

# llguidance's slicer: a mask skips walking the tokens of a slice whose every string the lexer
# allows (inside a JSON string, typically). Its default slices are JSON string runs of 1-10, 1-30
# and any length, so inside a string with ``maxLength`` below 30 every token of 11+ characters is
# walked (most of a 128K vocabulary's trie). Finer steps let shorter bounded strings skip more:
# bench/grammar.py's schema (strings of at most 24 and 40 characters), 128K vocabulary, one
# thread: 8.4 -> 5.7 ms to fill 32 masks; H200 batch 32: 7.8-8.2 % -> 3.1-4.1 % slower than free
# decoding (docs/BENCHMARKS.md). The masks are the same (tests/test_grammar.py); the tokenizer's
# set-up, once per process, takes ~40 % longer (0.7 -> 1.0 s at 128K tokens).
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
    the compiled one: copies share state that llguidance's thread pool serializes on. Measured on
    the H200 box (16 cores, 128K vocabulary, bench/grammar.py's schema): 32 masks in 10.6 ms from
    copies against 2.6 ms from fresh matchers; building one costs about a millisecond, once per
    turn, where ``begin`` runs."""

    def __init__(self, source: str, ll_tokenizer: Any, text: str) -> None:
        self.source = source  # what it was compiled from (the cache key)
        self._ll, self._text = ll_tokenizer, text  # what each turn's matcher is built from

    def start(self) -> Constraint:
        import llguidance

        return Constraint(llguidance.LLMatcher(self._ll, self._text, log_level=0))


class Constraint:
    """One turn's grammar state. ``accept`` advances it by the token the turn chose (the token was
    drawn from a masked row, so a refusal is a bug: it raises); ``done`` once the grammar ended
    (a stop token accepted)."""

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


_BITS = {}  # device -> [32] int32: 1 << k


def apply_bitmask(logits: torch.Tensor, masks: torch.Tensor, rows: Sequence[int]) -> None:
    """Set ``logits[rows[i], t]`` (fp32 ``[R, V]``, in place) to -inf wherever bit ``t`` of
    ``masks[i]`` (int32 ``[len(rows), ceil(V / 32)]``, on the logits' device) is 0: torch ops for
    all rows at once (the path off CUDA, and the reference of ``mask_kernel.mask_logits``)."""
    n, vocab = logits.shape
    bits = _BITS.get(logits.device)
    if bits is None:
        bits = _BITS[logits.device] = torch.ones(32, dtype=torch.int32, device=logits.device) << torch.arange(
            32, dtype=torch.int32, device=logits.device
        )
    drop = (masks.unsqueeze(-1) & bits).eq(0).view(masks.shape[0], -1)[:, :vocab]  # [C, V] bool
    if len(rows) == n and list(rows) == list(range(n)):
        logits.masked_fill_(drop, float("-inf"))
    else:
        index = torch.tensor(list(rows), dtype=torch.long).to(logits.device, non_blocking=True)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(drop, float("-inf")))


@dataclass
class _Fill:
    """Masks of ``constraints`` being filled into ``buf`` on ``thread`` (``StepMasks.start``)."""

    constraints: list[Constraint]
    buf: torch.Tensor  # [C * words] int32 first, room for the C row indices after
    thread: threading.Thread | None = None
    error: BaseException | None = None


class StepMasks:
    """The bitmask buffer of a step and the figures of its use (host seconds; see module doc)."""

    prefetch = True  # fill the next step's masks on a thread once the tokens are taken (``start``)

    def __init__(self) -> None:
        # C masks of ceil(V / 32) int32 words, then their C logit rows: one upload (pinned on CUDA)
        self._host: torch.Tensor | None = None
        self._bufs: list[torch.Tensor | None] = [None, None]  # of ``start``, used in turn
        self._flip = 0
        self._pending: _Fill | None = None
        self._words: int | None = None  # ceil(V / 32), known from the first ``apply``
        self._pin = False
        self._executor: Any = None  # llguidance's thread pool for several rows, made on first use
        self.rows = 0  # constrained rows masked, over all steps
        self.prefetched = 0  # of which filled ahead by ``start``
        self.fill_s = 0.0  # host time filling bitmasks (with ``start``: waiting for its thread)
        self.apply_s = 0.0  # host time launching (CUDA) or running (CPU) the masking

    def start(self, constraints: Sequence[Constraint]) -> None:
        """Fill the masks of ``constraints`` (their grammars as they stand now, this step's tokens
        taken) on a thread of its own while the engine thread goes on with the turns' other work;
        the next ``apply`` takes them for the rows of those constraints. The caller must not touch
        these matchers until then. The engine thread waits until the thread is inside llguidance,
        which runs without the GIL: a thread that had to win the GIL back from the engine thread's
        Python waited up to the interpreter's 5 ms switch interval (what made the earlier
        background fill slower, module doc)."""
        self._wait()
        if not (self.prefetch and constraints and self._words):
            return
        c, words = len(constraints), self._words
        self._flip ^= 1
        buf = self._bufs[self._flip] = self._room(self._bufs[self._flip], c, words)
        fill = _Fill(list(constraints), buf)
        inside = threading.Event()

        def run() -> None:
            try:
                self._fill(fill.constraints, buf[: c * words].view(c, words), inside)
            except BaseException as exc:  # the next apply fills again, and raises there
                fill.error = exc
            finally:
                inside.set()

        fill.thread = threading.Thread(target=run, name="turnkv-grammar-fill", daemon=True)
        fill.thread.start()
        inside.wait()
        self._pending = fill

    def apply(self, logits: torch.Tensor, rows: Sequence[tuple[int, Constraint]]) -> None:
        """Mask ``logits`` ``[R, V]`` (fp32, in place) at each ``(row, constraint)``."""
        t0 = time.perf_counter()
        fill = self._wait()
        if not rows:
            return
        words = self._words = (logits.shape[1] + 31) // 32
        self._pin = logits.device.type == "cuda"
        c = len(rows)
        size = c * (words + 1)
        cons = [con for _, con in rows]
        host = self._ahead(fill, cons, words)
        if host is None:
            host = self._host = self._room(self._host, c, words)
            self._fill(cons, host[: c * words].view(c, words))
        else:
            self.prefetched += c
        masks = host[: c * words].view(c, words)
        t1 = time.perf_counter()
        index = [r for r, _ in rows]
        with torch.inference_mode():  # the step's logits are inference tensors
            if logits.device.type == "cuda":
                from turnkv.engine.mask_kernel import mask_logits

                host.numpy()[c * words : size] = index
                mask_logits(logits, host[:size].to(logits.device, non_blocking=True), c)
            else:
                apply_bitmask(logits, masks, index)
        self.rows += c
        self.fill_s += t1 - t0
        self.apply_s += time.perf_counter() - t1

    def _wait(self) -> _Fill | None:
        """The fill ``start`` began (its thread ended), or None."""
        fill, self._pending = self._pending, None
        if fill is not None and fill.thread is not None:
            fill.thread.join()
        return fill

    def _ahead(self, fill: _Fill | None, cons: list[Constraint], words: int) -> torch.Tensor | None:
        """A buffer whose first ``len(cons)`` masks are ``cons``'s, from ``fill``: the fill's own
        when it filled exactly these (the usual step), else gathered from it when it filled all of
        them (a turn ended meanwhile); None when it did not."""
        if fill is None or fill.error is not None:
            return None
        done = fill.constraints
        if len(done) == len(cons) and all(a is b for a, b in zip(done, cons, strict=True)):
            return fill.buf
        at = {id(con): j for j, con in enumerate(done)}
        if not all(id(con) in at for con in cons):
            return None
        c = len(cons)
        host = self._host = self._room(self._host, c, words)
        src = fill.buf[: len(done) * words].view(len(done), words)
        idx = torch.tensor([at[id(con)] for con in cons], dtype=torch.long)
        torch.index_select(src, 0, idx, out=host[: c * words].view(c, words))
        return host

    def _room(self, buf: torch.Tensor | None, c: int, words: int) -> torch.Tensor:
        """``buf``, or a new one (pinned on CUDA) when it cannot hold ``c`` masks of ``words``
        int32 and their ``c`` row indices; at least 8 rows' worth, so small steps never regrow."""
        if buf is not None and buf.numel() >= c * (words + 1):
            return buf
        return torch.empty(max(c, 8) * (words + 1), dtype=torch.int32, pin_memory=self._pin)

    def _fill(
        self, cons: Sequence[Constraint], masks: torch.Tensor, inside: threading.Event | None = None
    ) -> None:
        """Write each constraint's bitmask into ``masks`` ``[C, words]`` (llguidance, no GIL)."""
        c, words = masks.shape
        if c == 1:
            if inside is not None:
                inside.set()
            cons[0].matcher.unsafe_compute_mask_ptr(masks.data_ptr(), words * 4)
            return
        if self._executor is None:
            import llguidance

            from turnkv.threads import available_cores

            # every core: the engine thread only waits meanwhile. llguidance's default (80 %)
            # takes 12 of 16 on the H200 box, i.e. three rounds for 32 rows instead of two
            self._executor = llguidance.LLExecutor(num_threads=available_cores())
        pairs = [(con.matcher, i) for i, con in enumerate(cons)]
        if inside is not None:
            inside.set()
        self._executor.unsafe_compute_mask_ptr(pairs, masks.data_ptr(), words * 4, c)
