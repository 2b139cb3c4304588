"""Cache breaks: why a turn's reused prefix ended where it did, decided once, at admission.

Every admitted turn gets one ``CacheBreak`` (``SessionBank.admit`` -> ``Lease.cache_break``;
the server writes it as ``usage.cache_break`` on every API and counts it in ``/metrics`` as
``turnkv_cache_breaks_total{reason}``). ``at`` is the number of prompt tokens reused (the first
one computed); ``reason`` one of:

- ``none``: nothing reusable was lost: the banked conversation was reused whole (the rest of the
  prompt is new), or every prompt row but the last (always recomputed) was restored;
- ``new_conversation``: nothing banked in the namespace starts like this prompt;
- ``history_differs``: the prompt leaves a banked conversation at token ``at`` (an edited or
  re-rendered earlier turn, a changed system prompt, a tool result sent differently);
- ``evicted``: a longer prefix was banked but its rows were evicted to make room (and no lower tier
  held them); ``detail`` names the rows lost;
- ``namespace``: a longer prefix is banked under another namespace of the same key (another
  ``cache_salt``), which never shares rows. Only namespaces of the caller's own key are looked at:
  a break never says what another key has banked;
- ``not_read``: the request reads no cached prefix (``SessionBank.admit``'s ``reuse``): it asks
  for the logprobs of its prompt's tokens (completions' ``echo`` with ``logprobs``), which need the
  logits of every prompt row, and a cached row has none.

Whatever the reason, ``detail`` ends with the rows that lower tiers brought back, when they did
(``rows restored from a lower tier: ram 11776, disk 256``; a ``none`` break's detail is then
only that, else None).

The evicted conversations are remembered as token ids only (``Evicted``: no rows, the newest
``EVICTED_TOKENS`` tokens in all), so an eviction is told apart from a new conversation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

from turnkv.bank.token_index import TokenIndex

EVICTED_TOKENS = 1 << 18  # token ids of evicted entries remembered, all namespaces together
REASONS = ("none", "new_conversation", "history_differs", "evicted", "namespace", "not_read")
SALT = "|salt:"  # what a request's cache_salt adds to its key's namespace (``server.app``)


@dataclass(frozen=True)
class CacheBreak:
    reason: str  # one of REASONS
    at: int  # prompt tokens reused
    detail: str | None = None

    def body(self) -> dict:
        return {"reason": self.reason, "at": self.at, "detail": self.detail}


NOT_READ = CacheBreak(
    "not_read", 0, "the prompt's logprobs need every prompt row's logits: no cached prefix is read"
)


class Evicted:
    """Token ids of evicted bank entries per namespace, the newest ``limit`` tokens in all."""

    def __init__(self, limit: int = EVICTED_TOKENS) -> None:
        self.limit = limit
        self._index: dict[str, TokenIndex] = {}
        self._order: OrderedDict[int, tuple[str, tuple[int, ...]]] = OrderedDict()
        self._tokens = 0
        self._ids = count(1)

    def add(self, namespace: str, tokens: tuple[int, ...]) -> None:
        gid = next(self._ids)
        self._index.setdefault(namespace, TokenIndex()).insert(tokens, gid)
        self._order[gid] = (namespace, tokens)
        self._tokens += len(tokens)
        while self._tokens > self.limit and self._order:
            old, (ns, toks) = self._order.popitem(last=False)
            index = self._index[ns]
            index.remove(toks, old)
            if index.empty:
                del self._index[ns]
            self._tokens -= len(toks)

    def longest(self, namespace: str, tokens: Sequence[int]) -> int:
        index = self._index.get(namespace)
        return index.longest(tokens)[0] if index is not None else 0


def siblings(namespace: str, namespaces: list[str]) -> list[str]:
    """The other namespaces of ``namespace``'s key (its other cache salts)."""
    key = namespace.split(SALT, 1)[0]
    return [ns for ns in namespaces if ns != namespace and ns.split(SALT, 1)[0] == key]


def decide(
    tokens: Sequence[int],
    cached: int,
    match: int,
    entry: tuple[int, ...] | None,
    evicted: int,
    elsewhere: int,
    restored: dict[str, int] | None = None,
) -> CacheBreak:
    """The break of a turn whose prompt is ``tokens``: ``cached`` rows restored, ``match`` tokens
    shared with the banked ``entry`` (its token ids) in memory, ``evicted`` shared with an
    evicted entry, ``elsewhere`` with an entry of a sibling namespace (``siblings``);
    ``restored``: the rows each lower tier brought back (the detail names them, after its reason's)."""
    brk = _decide(tokens, cached, match, entry, evicted, elsewhere)
    tiers = ", ".join(f"{name} {rows}" for name, rows in (restored or {}).items() if rows > 0)
    if not tiers:
        return brk
    note = f"rows restored from a lower tier: {tiers}"
    return CacheBreak(brk.reason, brk.at, f"{brk.detail}; {note}" if brk.detail else note)


def _decide(
    tokens: Sequence[int],
    cached: int,
    match: int,
    entry: tuple[int, ...] | None,
    evicted: int,
    elsewhere: int,
) -> CacheBreak:
    limit = max(len(tokens) - 1, 0)  # the last prompt row is always recomputed
    if cached >= limit:
        return CacheBreak("none", cached)
    if min(evicted, limit) > cached:
        return CacheBreak(
            "evicted",
            cached,
            f"prompt tokens [{cached}, {min(evicted, limit)}) were banked and evicted to make room "
            "(a larger --bank-bytes, or a RAM or disk tier, keeps them)",
        )
    if min(elsewhere, limit) > cached:
        return CacheBreak(
            "namespace",
            cached,
            f"the first {min(elsewhere, limit)} prompt tokens are banked under another cache_salt of "
            "this key; namespaces never share rows",
        )
    if cached > match or (entry is not None and match >= len(entry)):
        return CacheBreak("none", cached)  # a lower tier restored past the memory match, or it was whole
    if cached == 0 and match == 0:
        return CacheBreak("new_conversation", 0)
    if entry is not None and match < min(len(entry), len(tokens)):
        return CacheBreak(
            "history_differs",
            cached,
            f"the prompt differs from a banked conversation at token {match}: id {tokens[match]} "
            f"where the bank has {entry[match]}",
        )
    return CacheBreak("none", cached)
