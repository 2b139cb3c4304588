"""Admission: the one context check and the one price of a turn, before any work.

``reserve(request, ctx)`` checks the prompt against the context limit and the vocabulary and
returns the ``Reservation`` the bank prices (``SessionBank.admit``): the answer's rows plus the
rebase slack, how far an unset ``max_tokens`` may shrink to fit, and the transient bytes of one
prefill chunk. The server's early checks (``server.prompts``) use the same messages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from turnkv.bank.records import Reservation
from turnkv.engine.events import Failed, TurnRequest

if TYPE_CHECKING:
    from turnkv.engine.context import TurnContext

# rows reserved past the answer for the rebase (the last answer token and the end-of-turn tokens
# the template adds), so the tail need not regrow -- a copy -- to take them
REBASE_SLACK_ROWS = 8


@dataclass(frozen=True)
class Footprint:
    """What one prefill chunk's transient memory is made of (``activation_bytes``); this rank's
    shard under tensor parallelism."""

    hidden: int  # hidden size
    intermediate: int  # MLP rows
    item: int  # bytes of one activation value
    vocab: int  # the logits row, gathered whole on every rank
    prefill_chunk: int
    scratch: Callable[[int, int], int]  # the attention's bytes for (rows, history): its backend's


def activation_bytes(fp: Footprint, rows: int, history: int = 0) -> int:
    """Transient memory of one prefill chunk of ``rows`` rows over ``history`` cached rows: the
    hidden states and MLP of the chunk, the attention's scratch (``AttentionBackend.scratch_bytes``)
    and the logits row."""
    rows = min(rows, fp.prefill_chunk)
    hidden = rows * (6 * fp.hidden + 3 * fp.intermediate) * fp.item
    return hidden + fp.scratch(rows, history) + fp.vocab * 4


def prompt_too_long(limit: int, prompt: int | str) -> str:
    """The message of a prompt (``prompt`` tokens, or a bound on them) that leaves no room to answer."""
    return (
        f"This model's maximum context length is {limit} tokens. However, your prompt has {prompt} "
        f"tokens (at least one more is needed to answer). Shorten the messages."
    )


def check_context(ids: list[int], max_tokens: int | None, limit: int, vocab: int) -> Failed | None:
    """The one context check: ids in the vocabulary, the prompt plus one answer token (or the
    explicit max_tokens) fit."""
    if not ids:
        return Failed("invalid_request_error", "the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab:
        return Failed("invalid_request_error", f"prompt token ids must be in [0, {vocab})")
    if limit and len(ids) + 1 > limit:
        return Failed("context_length_exceeded", prompt_too_long(limit, len(ids)))
    if max_tokens is not None and limit and len(ids) + max_tokens > limit:
        return Failed(
            "context_length_exceeded",
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} in the "
            f"completion). Reduce the length of the messages or the completion.",
        )
    return None


def reserve(req: TurnRequest, ctx: TurnContext) -> Reservation | Failed:
    """The turn's reservation, or why it cannot run at all. Without ``max_tokens`` the answer gets
    the model's default (``models/generation.py``), fewer where the context cannot hold them, and
    the reservation may shrink to what the bank can hold (the answer then ends with
    ``finish_reason`` ``length``); an explicit ``max_tokens`` never shrinks."""
    ids, limit = req.prompt, ctx.max_context
    failed = check_context(ids, req.max_tokens, limit, ctx.vocab)
    if failed is not None:
        return failed
    # (max_tokens 0, the prompt alone, still reserves the row its last logits would decode into)
    max_tokens = max(req.max_tokens, 1) if req.max_tokens is not None else ctx.default_max_tokens
    if limit:
        max_tokens = min(max_tokens, limit - len(ids))
    slack = REBASE_SLACK_ROWS if req.render_history is not None else 0
    least = 1 + slack if req.max_tokens is None else None
    act = partial(activation_bytes, ctx.footprint)
    return Reservation(max_tokens + slack, least, slack, act, choices=req.n)
