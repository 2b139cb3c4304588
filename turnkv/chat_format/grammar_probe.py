"""A grammar's first steps, walked when it is compiled (``Grammars._compile``): what llguidance
only finds out once a turn runs (a grammar with no value at all, whose only token is the end of
the turn; a row of alternatives past its limits at the first ``{``; a lexer that runs out) is
found before the turn, as the reason to refuse the request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

PROBE_STEPS = 8  # tokens chosen along the walk (forced ones come free)
NO_VALUE = "the grammar admits no value"
_NEVER = 1 << 30  # the length of a token never chosen (end of turn, special, empty)


def token_lengths(ll_tokenizer: Any, vocab_size: int, eos: set[int]) -> np.ndarray:
    """[vocab_size] int64: the bytes of each token, ``_NEVER`` for those a walk must not choose."""
    lengths = []
    for t in range(vocab_size):
        try:
            n = len(ll_tokenizer.decode_bytes([t]))
        except (ValueError, IndexError, OverflowError):
            n = 0
        lengths.append(n if n and t not in eos else _NEVER)
    return np.array(lengths, dtype=np.int64)


def refusal(
    ll_tokenizer: Any, lengths: np.ndarray, matcher: Any, probes: Sequence[tuple[str, str]]
) -> str | None:
    """Why a compiled grammar (``matcher``, fresh) is refused, or None: its start walked, then the
    start of each of ``probes`` (a subschema compiled alone, named by its place; one that does not
    compile alone is left undecided)."""
    import llguidance

    problem = walk_start(matcher, lengths)
    if problem is not None:
        return problem if problem.startswith(NO_VALUE) else f"the grammar library cannot follow it: {problem}"
    for where, source in probes:
        alone = llguidance.LLMatcher(ll_tokenizer, source, log_level=0)
        problem = None if alone.is_error() else walk_start(alone, lengths)
        if problem is not None:
            return f"{where}: the grammar library cannot follow it: {problem}"
    return None


def walk_start(matcher: Any, lengths: np.ndarray) -> str | None:
    """None if the fresh ``matcher`` allows a first token other than the end of the turn and then
    takes ``PROBE_STEPS`` tokens without an error (each time the shortest one allowed: the one that
    opens a structure, where alternatives pile up); else what went wrong, in llguidance's words."""
    vocab = lengths.size
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)
    for step in range(PROBE_STEPS):
        forced = matcher.compute_ff_tokens()
        if (forced and not matcher.consume_tokens(forced)) or matcher.is_error():
            return _reason(matcher)
        if matcher.is_stopped():
            return None
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if matcher.is_error():
            return _reason(matcher)
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        pick = np.where(allowed, lengths, _NEVER)
        token = int(pick.argmin())
        if int(pick[token]) == _NEVER:  # only the end of the turn (or nothing) is allowed
            return (
                "the grammar admits no value (nothing but an empty answer)"
                if step == 0 and not forced
                else None
            )
        if not matcher.consume_token(token):
            return _reason(matcher)
    return None


def _reason(matcher: Any) -> str:
    """llguidance's error without the parser state it appends."""
    text = " ".join((matcher.get_error() or "invalid grammar").split("<state>")[0].split())[:400]
    return f"{NO_VALUE} (no first token)" if text.startswith("NoExtension") else text
