"""The records a turn is made of and gives back: what a request asks (``TurnRequest``), what a
step hands a turn (``WindowOutput``), the events a turn yields (``Admitted``, ``GenEvent``,
``Banked``, ``Failed``) and its figures (``TurnStats``). ``turn.Turn`` owns the life of a turn;
the server and the CLI read these types only."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from turnkv.bank.breaks import CacheBreak
from turnkv.engine.logprobs import TokenLogprob
from turnkv.engine.masks import TurnGrammar
from turnkv.engine.sampling import SamplingParams


@dataclass
class TurnRequest:
    """What a request asks once its body is parsed.

    ``max_tokens`` None means as many as the context and the bank budget allow, at most the
    engine's default (``Engine.sampling_defaults``: ``--max-tokens``, the model's, else
    ``generation.DEFAULT_MAX_TOKENS``); an explicit value that does not fit the context is refused
    (``context_length_exceeded``), as with vLLM.
    ``render_history`` (optional) returns the token ids the client will send back for this
    conversation once the answer text is appended (the chat template applied to the history plus
    the answer); the turn banks rows matching those ids, so the next turn reuses all of them.
    ``logprobs`` (0-20, None: off) puts a ``TokenLogprob`` on every answer token's ``GenEvent``
    but an end-of-sequence token's (``engine.logprobs``: what the distribution is).
    ``grammar`` (optional, compiled by ``chat_format.grammar``) constrains every answer token: the step
    masks the turn's logits row before any choice, the answer ends when the grammar is complete
    (also under ``ignore_eos``), and the turn never drafts (no speculation under a grammar).
    ``n`` > 1 answers ``n`` choices of one prompt: prefilled once, then forked (``Turn``'s
    "Choices"); choice ``i`` samples with ``seed + i``, and every event of it carries ``choice`` i.
    ``prompt_logprobs`` (0-20, None: off) scores the prompt itself: every prompt token after the
    first gets a ``TokenLogprob`` from the logits of the row before it, computed in the prompt's own
    prefill windows (``step.Window.scores``), so the turn reads no cached prefix (a cached row has
    no logits; its break is ``not_read``). They come on each choice's first ``GenEvent``.
    ``max_tokens`` 0 answers nothing: the turn ends (``length``) once its prompt is computed.
    """

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    namespace: str = ""
    session: str | None = None
    render_history: Callable[[str], list[int]] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    grammar: TurnGrammar | None = None
    logprobs: int | None = None  # each answer token's logprob, with this many top alternatives
    n: int = 1  # choices: forks of this prompt once it is prefilled (``Turn``'s "Choices")
    choice: int = 0  # which of the request's choices this turn is (a fork's is 1..n-1)
    prompt_logprobs: int | None = None  # each prompt token's logprob (after the first), this many top


@dataclass
class TurnStats:
    """Figures of one turn (reported by ``turnkv generate --json`` and the server's usage)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt rows the bank already held
    prefilled_tokens: int = 0  # prompt rows computed by this turn
    completion_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_tok_s: float = 0.0
    forwards: int = 0  # steps this turn took part in
    queue_s: float = 0.0  # from submit to admission (waiting for memory or a running slot)
    token_gaps_s: list[float] = field(default_factory=list, repr=False)  # between answer tokens
    decode_forwards: int = 0  # of which decode windows (one row, or a verify window)
    drafted: int = 0  # tokens drafted from the conversation and verified (context-copy speculation)
    accepted: int = 0  # drafted tokens the target model agreed with
    verify_windows: int = 0  # decode windows that carried a draft
    rebase_rows: int = 0
    route_counts: dict[str, int] = field(default_factory=dict)
    cache_break: CacheBreak | None = None  # the admission's (``bank.breaks``; a fork's: None)


@dataclass
class WindowOutput:
    """What a step hands one window's turn: the tokens chosen for the rows it asked logits for
    (``chooser.window_tokens``: a verify window's as far as its drafts were kept, then the
    correction or the bonus), and the route label of its attention calls (``calls`` of them: one
    per layer)."""

    tokens: list[int]
    route: str = ""
    calls: int = 0
    logprobs: list[TokenLogprob] | None = None  # per token, when the turn asked (``engine.logprobs``)
    prompt_logprobs: list[TokenLogprob] | None = None  # of the window's ``scores`` tokens, in order


@dataclass(frozen=True)
class Admitted:
    prompt_tokens: int
    cached_tokens: int
    needed_bytes: int
    cache_break: CacheBreak | None = None  # why the reused prefix ends where it does (``bank.breaks``)


@dataclass
class GenEvent:
    """One sampled token and the text it made final; the last event carries the end."""

    token_id: int | None
    text: str
    logprob: TokenLogprob | None = None  # when the turn asked (never on an end-of-sequence token)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    stats: TurnStats | None = None
    stop_sequence: str | None = None  # the stop string that ended the answer ("stop" without one: EOS)
    choice: int = 0  # which choice of the request (``TurnRequest.n``)
    # on a choice's first event when the turn asked (``TurnRequest.prompt_logprobs``): prompt
    # tokens 1..P-1's logprobs (the first prompt token has none)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Banked:
    entry_id: int | None
    banked_tokens: int
    rebase_rows: int  # rows recomputed after the answer so the bank matches the re-rendered history
    choice: int = 0


@dataclass(frozen=True)
class Forked:
    """The prompt is prefilled and ``choices - 1`` forks of it run beside the turn (``TurnRequest.n``):
    that many more ``Banked`` or ``Failed`` events will come, one per fork."""

    choices: int


@dataclass(frozen=True)
class Failed:
    """A turn that ended without an answer. ``code``: ``invalid_request_error``,
    ``context_length_exceeded``, ``kv_memory_exhausted`` (with the byte counts), ``cancelled``,
    ``queue_timeout``, ``tensor_parallel_down`` (``DOWN_CODE``) or ``internal_error``; the server
    maps it to an HTTP status."""

    code: str
    message: str
    needed_bytes: int | None = None
    available_bytes: int | None = None

    @classmethod
    def group_down(cls, error: str | None) -> Failed:
        """A turn ended (or refused) because a tensor-parallel rank died (HTTP 503)."""
        msg = f"the tensor-parallel group is down ({error}); this server can no longer run turns: restart it"
        return cls(DOWN_CODE, msg)


DOWN_CODE = "tensor_parallel_down"  # the Failed code of turns ended by a dead rank


TurnEvent = Admitted | GenEvent | Banked | Failed | Forked
