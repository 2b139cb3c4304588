"""Constrained decoding: compiled grammars, one matcher per turn, the masks of a step.

The grammar library is xgrammar (chosen by ``bench/grammar_libs.py``: the cheapest mask per token
of xgrammar, llguidance and outlines-core on this CPU, at the default model's 49152-token
vocabulary and at a 128K one; figures and the reasons in docs/BENCHMARKS.md). It is imported on
first use (the import takes ~2.6 s), so a server that never constrains never pays for it.

- ``Grammars`` compiles for one tokenizer and one logit width (thread-safe; the HTTP handlers
  compile in their thread pool, never on the engine thread). A compiled grammar is cached by its
  source, so an agent that resends the same tools every turn compiles them once.
- ``Grammar.start()`` gives a turn its ``Constraint`` (the matcher: which tokens may come next).
- ``StepMasks.apply`` runs once per step, after the forward is launched and before the step's
  batched argmax: it fills the bitmask of every constrained row on the host (on CUDA this
  overlaps the forward) and applies them to those rows of the step's logits in one call, so the
  batched argmax and every sampler see masked rows. Unconstrained rows are not touched.

JSON is constrained to the layout ``json.dumps`` writes (``", "`` and ``": "``, no newlines):
chat templates re-render a tool call's arguments with ``tojson``, so the banked rows of a tool
call match what the next request renders, and no model can loop on whitespace.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from turnkv.tokenizer import Tokenizer

SEPARATORS = (", ", ": ")  # json.dumps's, and so tojson's in a chat template
CACHE_ENTRIES = 256  # compiled grammars kept (by source); an entry is ~100 KB at a 128K vocabulary

# Keywords xgrammar 0.2.9 accepts but does not enforce (it logs a warning, or nothing): a schema
# with one is refused, since its output could not be guaranteed to validate. Measured by compiling
# each keyword alone and generating against it (tests/test_grammar.py keeps the list honest).
UNENFORCED = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired", "contains")
LOOKAROUND = re.compile(r"\(\?<?[=!]")
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled or enforced; the message says what and where."""


def unenforced(schema: Any, path: str = "#") -> str | None:
    """The first keyword of ``schema`` the library would not enforce, as ``keyword at path``."""
    if isinstance(schema, list):
        for i, s in enumerate(schema):
            found = unenforced(s, f"{path}/{i}")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key in UNENFORCED:
        if key in schema:
            return f"`{key}` at {path}"
    if schema.get("uniqueItems") is True:
        return f"`uniqueItems` at {path}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"`allOf` with {len(schema['allOf'])} schemas at {path}"
    m = schema.get("multipleOf")
    if m is not None and schema.get("type") != "integer":
        return f"`multipleOf` on a non-integer at {path}"
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and LOOKAROUND.search(pattern):
        return f"a look-around in `pattern` at {path}"
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    for key in ("pattern", "format"):
        if key in schema and lengths:
            return f"`{key}` together with `{lengths[0]}` at {path}"
    for key, sub in schema.items():
        if key in ("enum", "const", "default", "examples", "description", "title"):
            continue
        if isinstance(sub, (dict, list)):
            found = unenforced(sub, f"{path}/{key}")
            if found:
                return found
    return None


# xgrammar 0.2.9 writes a string with minLength/maxLength as `[^"\\\r\n]{m,n}`, which lets
# control characters through (invalid JSON; found by tests/test_grammar.py): such a string is
# given the equivalent pattern instead, which excludes them (and escapes: a subset, still valid)
_PLAIN_CHARS = '[^\\x00-\\x1f"\\\\]'


def bounded_strings(schema: Any) -> Any:
    """``schema`` with every ``minLength``/``maxLength`` string (no pattern, no format) rewritten
    as the pattern of that many plain characters (a copy; data keywords are left alone)."""
    if isinstance(schema, list):
        return [bounded_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: v if k in ("enum", "const", "default", "examples") else bounded_strings(v)
        for k, v in schema.items()
    }
    kind = out.get("type")
    stringy = kind == "string" or (isinstance(kind, list) and "string" in kind)
    if (
        stringy
        and ("minLength" in out or "maxLength" in out)
        and "pattern" not in out
        and "format" not in out
    ):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{_PLAIN_CHARS}{{{lo},{hi}}}$"
    return out


def _message(exc: Exception) -> str:
    """xgrammar's error text without its C++ source prefix."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", first)


@dataclass(frozen=True)
class ToolCallShape:
    """One function a tool-call grammar may emit: ``begin`` (the format's text up to the arguments,
    the name included), the arguments' JSON schema (None: any JSON object), ``end``."""

    begin: str
    parameters: dict | None
    end: str


class Grammar:
    """A compiled grammar; ``start()`` gives a fresh matcher for one turn."""

    def __init__(self, compiled: Any, source: str) -> None:
        self.compiled = compiled
        self.source = source  # what it was compiled from (the cache key; for messages and tests)

    def start(self) -> Constraint:
        import xgrammar as xg

        return Constraint(xg.GrammarMatcher(self.compiled))


class Constraint:
    """One turn's grammar state. ``accept`` advances it by the token the turn chose (the token was
    drawn from a masked row, so a refusal is a bug: it raises); ``done`` once a stop token was
    accepted."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_terminated())


class Grammars:
    """Compiles grammars for one tokenizer whose model has ``vocab_size`` logits per row (ids the
    tokenizer does not know, the padding of the logit width, are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.threads = threads
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()

    def compiler(self) -> Any:
        """xgrammar's compiler over this tokenizer (built once: ~0.4 s at 49152 tokens)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xg
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
                info = xg.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=sorted(self.tokenizer.eos_token_ids)
                )
                self._compiler = xg.GrammarCompiler(info, max_threads=self.threads)
            return self._compiler

    def _cached(self, key: str, build) -> Grammar:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            grammar = Grammar(build(self.compiler()), key)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(_message(e)) from None
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return grammar

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's ``json_object`` mode)."""
        return self._cached(
            "json_object",
            lambda c: c.compile_json_schema(
                {"type": "object"}, any_whitespace=False, separators=SEPARATORS, strict_mode=False
            ),
        )

    def json_schema(self, schema: dict) -> Grammar:
        """A JSON value valid against ``schema``; properties a schema does not declare are not
        generated (xgrammar's strict mode: the output is still valid). Raises GrammarError."""
        _check_schema(schema, "the schema")
        key = "schema:" + json.dumps(schema, sort_keys=True)
        return self._cached(
            key,
            lambda c: c.compile_json_schema(
                bounded_strings(schema), any_whitespace=False, separators=SEPARATORS
            ),
        )

    def tool_calls(self, calls: Sequence[ToolCallShape], separator: str | None) -> Grammar:
        """At least one call of ``calls`` (each ``begin + arguments + end``), several separated by
        ``separator`` when it is not None, and nothing else. Raises GrammarError."""
        import xgrammar as xg

        tags = []
        for call in calls:
            params = call.parameters if call.parameters is not None else {"type": "object"}
            _check_schema(params, f"the parameters of {call.begin!r}")
            try:
                body = xg.Grammar.from_json_schema(
                    bounded_strings(params),
                    any_whitespace=False,
                    separators=SEPARATORS,
                    strict_mode=call.parameters is not None,
                )
            except (RuntimeError, ValueError, TypeError) as e:
                raise GrammarError(f"{_message(e)} (in the parameters of {call.begin!r})") from None
            tags.append(
                {
                    "type": "tag",
                    "begin": call.begin,
                    "content": {"type": "grammar", "grammar": str(body)},
                    "end": call.end,
                }
            )
        fmt = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": separator or "",
            "at_least_one": True,
            "stop_after_first": separator is None,
        }
        tag = json.dumps({"type": "structural_tag", "format": fmt}, sort_keys=True)
        return self._cached("tools:" + tag, lambda c: c.compile_structural_tag(tag))


def _check_schema(schema: Any, what: str) -> None:
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON object (got {type(schema).__name__})")
    found = unenforced(schema)
    if found:
        raise GrammarError(
            f"{what} uses {found}, which the grammar library (xgrammar) does not enforce, so the "
            "output could not be guaranteed to validate; remove it or check it in the client"
        )


class StepMasks:
    """The bitmask buffer of a step and the figures of its use (host seconds; see module doc)."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, pinned on CUDA
        self._batch: Any = None  # xgrammar's threaded filler (half the cores), made on first use
        self.rows = 0  # constrained rows masked, over all steps
        self.fill_s = 0.0  # host time filling bitmasks
        self.apply_s = 0.0  # host time launching (CUDA) or running (CPU) the masking

    def apply(self, logits: torch.Tensor, rows: Sequence[tuple[int, Constraint]]) -> None:
        """Mask ``logits`` ``[R, V]`` (fp32, in place) at each ``(row, constraint)``."""
        if not rows:
            return
        import time

        import xgrammar as xg

        t0 = time.perf_counter()
        n, vocab = logits.shape
        words = (vocab + 31) // 32
        host = self._host
        if host is None or host.shape[0] < n or host.shape[1] != words:
            pin = logits.device.type == "cuda"
            host = self._host = torch.empty((max(n, 8), words), dtype=torch.int32, pin_memory=pin)
        index = [r for r, _ in rows]
        if len(rows) == 1:
            rows[0][1].matcher.fill_next_token_bitmask(host, index[0])
        else:
            if self._batch is None:
                self._batch = xg.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([c.matcher for _, c in rows], host, index)
        t1 = time.perf_counter()
        mask = host[:n].to(logits.device, non_blocking=True) if logits.device.type != "cpu" else host[:n]
        xg.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=index)
        self.rows += len(rows)
        self.fill_s += t1 - t0
        self.apply_s += time.perf_counter() - t1
