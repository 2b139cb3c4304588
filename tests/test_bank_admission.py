"""Admission that never refuses a turn that fits (issue 7, items 1-3), over real segmented caches.

Pins: a short hit out of a large idle segment copies its rows instead of pinning the segment; a turn
is refused exactly when even evicting every evictable entry leaves too little room (hypothesis,
against that oracle); session protection expires, is capped, and never refuses a turn; a request
without ``max_tokens`` gets the reservation the budget can hold.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_bank import ROW, SHAPE, _append, _conversation

from turnkv.bank.records import Reservation
from turnkv.bank.session_bank import MustWait, Refused, SessionBank
from turnkv.kv.segments import SegmentedLayout, unique_bytes


def _bank(budget_rows: int, **kw) -> SessionBank:
    return SessionBank(budget_rows * ROW, ROW, lambda held: unique_bytes(*held), **kw)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


CHATML = [1, 2, 3]  # every ChatML chat starts with the same 3 tokens


# -- item 1: a short hit does not pin a large idle segment -------------------------------------


def test_a_three_token_hit_does_not_pin_an_idle_517_row_conversation():
    """The issue's numbers in rows: A (517 rows, idle) and B (447-token prompt) share 3 tokens; B
    fits once A is evicted. Before: B restored 3 rows of A's segment, pinned all 517, got a 507."""
    layout = SegmentedLayout(SHAPE)
    bank = _bank(1100)
    a = _conversation(layout, [*CHATML, *range(100, 614)])  # one 517-row segment
    bank.insert("ns", a.snapshot())
    b_prompt = [*CHATML, *range(1000, 1444)]  # 447 tokens
    lease = bank.admit("ns", b_prompt, Reservation(200))  # 444 + 200 rows do not fit beside 517
    assert lease.cached == 3 and lease.copied_rows == 3
    assert bank.stats.evictions == 1 and len(bank) == 0  # A went
    a_seg = {s.id for s in a.snapshot().segments()}
    assert not a_seg & {s.id for s in lease.snapshot.segments()}  # the 3 rows are B's own copy
    assert bank.unique_bytes(live=True) == 3 * ROW  # nothing of A is held any more
    live = layout.restore(lease.snapshot)
    assert live.tokens == CHATML
    bank.finish(lease)


def test_a_hit_is_restored_by_reference_while_there_is_room():
    layout = SegmentedLayout(SHAPE)
    bank = _bank(10_000)
    a = _conversation(layout, [*CHATML, *range(100, 614)])
    bank.insert("ns", a.snapshot())
    lease = bank.admit("ns", [*CHATML, *range(1000, 1444)], Reservation(200))
    assert lease.cached == 3 and lease.copied_rows == 0 and bank.stats.evictions == 0
    assert {s.id for s in lease.snapshot.segments()} <= {s.id for s in a.snapshot().segments()}
    bank.finish(lease)


def test_a_long_hit_keeps_its_reference_and_evicts_others_first():
    layout = SegmentedLayout(SHAPE)
    bank = _bank(1300)
    a = _conversation(layout, list(range(600)))
    other = _conversation(layout, list(range(5000, 5400)))
    bank.insert("ns", other.snapshot())
    bank.insert("ns", a.snapshot())
    # continues 590 of A's 600 rows (more than half): referenced, the other entry is evicted
    lease = bank.admit("ns", [*range(590), 7, 7, 7], Reservation(350))
    assert lease.cached == 590 and lease.copied_rows == 0
    assert bank.lookup("ns", list(range(600)))[0] == 600
    assert bank.lookup("ns", list(range(5000, 5400)))[0] == 0
    bank.finish(lease)


@st.composite
def _banks(draw):
    """Conversations that fork from each other's prefixes, a prompt continuing one, a budget."""
    layout = SegmentedLayout(SHAPE)
    convs: list[list[int]] = []
    snaps = []
    for i in range(draw(st.integers(1, 4))):
        if convs and draw(st.booleans()):
            src = draw(st.integers(0, len(convs) - 1))
            cut = draw(st.integers(1, len(convs[src])))
            cache = layout.restore(snaps[src].prefix(cut))
            tokens = convs[src][:cut]
        else:
            cache, tokens = layout.new(), []
        for t in range(draw(st.integers(1, 3))):
            turn = [1000 * (i + 1) + 10 * t + j for j in range(draw(st.integers(1, 40)))]
            _append(cache, turn, seed=i * 10 + t)
            tokens += turn
        convs.append(tokens)
        snaps.append(cache.snapshot())
    src = draw(st.integers(0, len(convs) - 1))
    cut = draw(st.integers(0, len(convs[src])))
    prompt = convs[src][:cut] + [7] * draw(st.integers(1, 30))
    return snaps, prompt, draw(st.integers(1, 60)), draw(st.integers(1, 250))


@settings(max_examples=120, deadline=None)
@given(_banks())
def test_refused_exactly_when_evicting_everything_would_not_make_room(case):
    """With no live turn, everything is evictable: the turn fits iff its prompt and reservation fit
    the budget (restored rows cost the same referenced whole or copied)."""
    snaps, prompt, reserve, budget_rows = case
    bank = _bank(100_000)
    for s in snaps:
        bank.insert("ns", s)
    entries = len(bank)
    bank.budget_bytes = budget_rows * ROW
    fits = (len(prompt) + reserve) * ROW <= bank.budget_bytes
    try:
        lease = bank.admit("ns", prompt, Reservation(reserve))
    except Refused as e:
        assert not fits, (len(prompt), reserve, budget_rows)
        assert e.needed_bytes > e.available_bytes
        assert len(bank) == entries and bank.stats.evictions == 0  # a refusal evicts nothing
        return
    assert fits
    bank.check_integrity()  # the running byte count after evictions equals a full re-measure
    # everything held now, plus what the turn was priced (its copies are in both), fits the budget
    assert bank.unique_bytes(live=True) - lease.copied_rows * ROW + lease.needed_bytes <= bank.budget_bytes
    assert lease.snapshot is None or lease.snapshot.tokens == tuple(prompt[: lease.cached])
    bank.finish(lease)
    bank.check_integrity()


# -- item 2: session protection expires, is capped, and never refuses ---------------------------


def test_idle_protected_sessions_never_refuse_a_turn_that_fits_without_them():
    """Two idle X-Session-Id sessions filled a 64M bank and every later turn of their size got 507
    for as long as the server ran; now the turn evicts a protected entry (counted)."""
    layout = SegmentedLayout(SHAPE)
    bank = _bank(1000, session_share=1.0)
    for s in ("a", "b"):
        snap = _conversation(layout, [ord(s) * 1000 + i for i in range(400)]).snapshot()
        bank.insert("ns", snap, session=s)
    assert len(bank.protected()) == 2
    lease = bank.admit("ns", list(range(300)), Reservation(100))  # 400 rows: one entry must go
    assert bank.stats.evictions == 1 and bank.stats.protected_evictions == 1
    bank.finish(lease)


def test_session_protection_expires_after_its_ttl():
    layout = SegmentedLayout(SHAPE)
    clock = Clock()
    bank = _bank(60, session_ttl_s=60, clock=clock)
    protected = _conversation(layout, list(range(20))).snapshot()
    bank.insert("ns", protected, session="s")
    clock.t = 30
    newer = _conversation(layout, list(range(100, 120))).snapshot()
    bank.insert("ns", newer)
    assert bank.protected() == {1}
    lease = bank.admit("ns", list(range(200, 225)), Reservation(5))  # needs one entry's room
    assert bank.lookup("ns", protected.tokens)[0] == 20  # protected: the newer entry went
    bank.finish(lease)
    bank.insert("ns", newer)
    clock.t = 61  # the session's last turn was 61 s ago
    assert bank.protected() == set()
    lease = bank.admit("ns", list(range(300, 325)), Reservation(5))
    assert bank.lookup("ns", protected.tokens)[0] == 0  # now plain LRU: the older entry goes
    assert bank.lookup("ns", newer.tokens)[0] == 20
    bank.finish(lease)


def test_session_protection_is_capped_at_its_share_of_the_budget():
    layout = SegmentedLayout(SHAPE)
    clock = Clock()
    bank = _bank(100, session_share=0.3, clock=clock)  # protected entries may hold 30 rows
    old = _conversation(layout, list(range(20))).snapshot()
    bank.insert("ns", old, session="old")
    clock.t = 1
    new = _conversation(layout, list(range(100, 120))).snapshot()
    bank.insert("ns", new, session="new")
    assert bank.protected() == {2}  # the most recent session first; the other would pass 30 rows


def test_a_turn_of_the_same_session_touches_its_protection():
    layout = SegmentedLayout(SHAPE)
    clock = Clock()
    bank = _bank(1000, session_ttl_s=60, clock=clock)
    snap = _conversation(layout, list(range(20))).snapshot()
    bank.insert("ns", snap, session="s")
    clock.t = 50
    bank.finish(bank.admit("ns", [*range(20), 5], Reservation(1), session="s"))
    clock.t = 100  # 50 s after the session's last turn
    assert len(bank.protected()) == 1


# -- item 3: without max_tokens the reservation is what the budget allows -----------------------


def test_a_shrinkable_reservation_takes_what_the_budget_can_hold():
    bank = _bank(100)
    lease = bank.admit("ns", list(range(30)), Reservation(4096, least=1))
    assert lease.reserve_rows == 70 and lease.needed_bytes == 100 * ROW
    bank.finish(lease)
    with pytest.raises(Refused):
        bank.admit("ns", list(range(30)), Reservation(4096))  # an explicit reservation never shrinks
    with pytest.raises(Refused):
        bank.admit("ns", list(range(100)), Reservation(4096, least=1))  # no room for one


class WritingTier:
    """A disk tier whose queued write holds ``snapshot`` until ``flush`` (the bank counts it)."""

    def __init__(self, snapshot) -> None:
        self.queued = [snapshot]
        self.flushes = 0

    def extend(self, namespace, tokens, prefix):
        return None

    def write_behind(self, namespace, snapshot) -> None:
        pass

    def held(self):
        return list(self.queued)

    def flush(self, timeout=None) -> bool:
        self.flushes += 1
        self.queued.clear()
        return True


def test_admission_waits_for_the_disk_tiers_queued_writes_rather_than_refuse():
    """A conversation just banked is still held by its disk write for a moment: a turn that fits
    once the write is done waits for it (it was a 507 right after the merge of the disk tier)."""
    layout = SegmentedLayout(SHAPE)
    a = _conversation(layout, [*CHATML, *range(100, 614)]).snapshot()
    bank = _bank(1100)
    bank.tier = WritingTier(a)
    bank.insert("ns", a)
    lease = bank.admit("ns", [*CHATML, *range(1000, 1444)], Reservation(200))
    assert bank.tier.flushes == 1 and lease.copied_rows == 3 and bank.stats.refusals == 0
    bank.finish(lease)
    with pytest.raises(Refused):  # nothing to wait for: refused at once
        bank.admit("ns", list(range(2000, 3200)), Reservation(1))
    assert bank.tier.flushes == 1 and bank.stats.refusals == 1


def test_a_turn_that_fits_once_the_running_turns_finish_waits():
    """With many turns per step, eight clients arriving together on a 64M bank got 507 while the
    first one ran; a turn that fits once the live turns finish now waits (the scheduler retries)."""
    bank = _bank(100)
    running = bank.admit("ns", list(range(50)), Reservation(20))
    with pytest.raises(MustWait):
        bank.admit("ns", list(range(100, 150)), Reservation(20), wait=True)
    assert bank.stats.refusals == 0
    with pytest.raises(Refused):  # a caller that cannot wait gets the 507
        bank.admit("ns", list(range(100, 150)), Reservation(20))
    with pytest.raises(Refused) as e:  # too large even alone: refused, not told to wait
        bank.admit("ns", list(range(100, 250)), Reservation(20), wait=True)
    assert not isinstance(e.value, MustWait)
    bank.finish(running)
    bank.finish(bank.admit("ns", list(range(100, 150)), Reservation(20), wait=True))
