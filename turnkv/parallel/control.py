"""Replicated control: every rank runs the same scheduler, turns and bank; rank 0 sends the inputs.

Rank 0 tokenizes, answers HTTP and decides what enters the engine. Every rank runs the same
``Scheduler`` (admission, windows, sampling, stop strings, rebase, seal, bank) over its own shard
of every cache, so each rank's segments, snapshots, forks, rollbacks and bank decisions are the
same as rank 0's, on its own KV heads, with the same segment ids. For that, every input a rank
could not compute itself comes from rank 0, once per step, before the step runs:

- the turns submitted since the last step (prompt ids, sampling parameters with a seed drawn on
  rank 0 when the request gave none, ``max_tokens``, namespace, session, history record);
- cancellations, *latched*: a client's cancel flag only reaches the turn (on rank 0 too) through
  this message, so every rank sees it at the same step;
- new session banks (their byte budget) and schedulers (their limits), and the ones rank 0 let go.

Everything else is computed alike on every rank: the logits are bit-identical after the
collectives (``group.py``), so argmax and seeded samples agree; time is read only for statistics;
the bank's clock is logical. Each rank's disk tier holds its shard of the same blocks, and a
restore takes only what every rank found intact (``DiskTier.agree``).

Wire format (gloo control group, rank 0 broadcasts, the others receive in order): a header
``int64[5] = (seq, kind, scheduler key, payload bytes, digest)`` and, when the payload is not
empty, the pickled ``Inputs``. ``digest`` is rank 0's ``Scheduler.digest()`` before
the step; a rank whose own differs has diverged and exits rather than compute wrong rows. Rank 0
sends a heartbeat every ``HEARTBEAT_S`` while idle, so a silent rank 0 is told from an idle one.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from turnkv.chat_format.history import history_from_spec, history_spec
from turnkv.engine.events import Failed, TurnRequest
from turnkv.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Callable

    from turnkv.bank.session_bank import SessionBank
    from turnkv.engine.scheduler import Scheduler
    from turnkv.parallel.group import Group
    from turnkv.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STEP, HEARTBEAT, STOP = 1, 2, 3
HEADER = 5
HEARTBEAT_S = 1.0


class Diverged(RuntimeError):
    """This rank's scheduler state no longer matches rank 0's."""


@dataclass(frozen=True)
class NewTurn:
    key: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int | None
    namespace: str
    session: str | None
    history: tuple[str, object] | None
    n: int = 1  # choices: every rank forks the prompt alike (``Turn``)


@dataclass
class Inputs:
    """What rank 0 tells the others before one step (or with a heartbeat)."""

    banks: list[tuple[int, int, bool]] = field(default_factory=list)  # (key, budget bytes, disk), first seen
    schedulers: list[tuple[int, int, int, int]] = field(default_factory=list)  # key, bank, limits
    turns: list[NewTurn] = field(default_factory=list)  # submitted since the last step, in order
    cancels: list[int] = field(default_factory=list)  # turn keys cancelled since the last step
    drops: list[tuple[str, int]] = field(default_factory=list)  # ("bank"|"scheduler", key) gone

    def __bool__(self) -> bool:
        return bool(self.banks or self.schedulers or self.turns or self.cancels or self.drops)


class Leader:
    """Rank 0's side, the schedulers' ``StepHook`` (``runtime.build``): ``latch`` on submit and
    ``announce`` before each step; a thread sends heartbeats while nothing else is sent."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._lock = threading.RLock()  # finalizers (_forget) may run inside a locked region
        self._seq = 0
        self._last = time.monotonic()
        self._keys = itertools.count(1)
        self._known: dict[int, int] = {}  # id(bank or scheduler) -> key
        self._pending = Inputs()  # registrations, drops
        self._new: dict[int, list[NewTurn]] = {}  # scheduler key -> turns to announce
        self._latched: dict[int, tuple[threading.Event, weakref.ref]] = {}  # turn key -> flags
        self._stopped = False
        self._beat = threading.Thread(target=self._heartbeat, name="turnkv-tp-heartbeat", daemon=True)
        self._beat.start()

    # -- called by the scheduler (engine thread) -----------------------------------------------
    def latch(self, sched: Scheduler, request: TurnRequest) -> TurnRequest:
        """The request the turn runs on every rank: its own cancel flag (set only by
        ``announce``) and a concrete seed."""
        params = request.params
        if not params.greedy and params.seed is None:
            params = replace(params, seed=secrets.randbits(62))
        spec = history_spec(request.render_history)
        mine = replace(request, params=params, cancel=threading.Event())
        with self._lock:
            skey = self._register(sched)
            tkey = next(self._keys)
            self._latched[tkey] = (request.cancel, weakref.ref(mine))
            r = request
            turn = NewTurn(tkey, list(r.prompt), params, r.max_tokens, r.namespace, r.session, spec, r.n)
            self._new.setdefault(skey, []).append(turn)
        return mine

    def announce(self, sched: Scheduler) -> bool:
        """Send this step's inputs; False (every turn of ``sched`` failed) when the group is down."""
        with self._lock:
            health = self.group.health
            if health.ok:
                skey = self._register(sched)
                inputs, self._pending = self._pending, Inputs()
                inputs.turns = self._new.pop(skey, [])
                inputs.cancels = self._take_cancels()
                try:
                    self._send(STEP, skey, inputs, sched.digest())
                except Exception as exc:
                    self.group.down(f"sending a step to the other ranks failed: {type(exc).__name__}: {exc}")
        if health.ok:
            return True
        sched.fail_all(Failed.group_down(health.error))
        return False

    def stop(self) -> None:
        """Tell the other ranks to exit (after rank 0's last step) and wait until they all have
        the message, so no rank leaves the group while another still talks to it."""
        with self._lock:
            if not self._stopped and self.group.health.ok:
                self._send(STOP, 0, self._pending, 0)
                dist.barrier(group=self.group.control)
            self._stopped = True

    # -- internals (hold the lock) ----------------------------------------------------------------
    def _register(self, sched: Scheduler) -> int:
        bank = sched.bank
        if id(bank) not in self._known:
            key = self._track(bank, "bank")
            self._pending.banks.append((key, bank.budget_bytes, bank.tier is not None))
        if id(sched) not in self._known:
            key = self._track(sched, "scheduler")
            limits = (sched.max_running, sched.max_batch_tokens)
            self._pending.schedulers.append((key, self._known[id(bank)], *limits))
        return self._known[id(sched)]

    def _track(self, obj: object, kind: str) -> int:
        key = next(self._keys)
        self._known[id(obj)] = key
        weakref.finalize(obj, self._forget, kind, id(obj), key)
        return key

    def _forget(self, kind: str, ident: int, key: int) -> None:  # any thread, at garbage time
        with self._lock:
            self._known.pop(ident, None)
            self._pending.drops.append((kind, key))

    def _take_cancels(self) -> list[int]:
        out = []
        for tkey, (flag, ref) in list(self._latched.items()):
            mine = ref()
            if mine is None:  # the turn is gone
                del self._latched[tkey]
            elif flag.is_set() and not mine.cancel.is_set():
                mine.cancel.set()
                out.append(tkey)
        return out

    def _send(self, kind: int, skey: int, inputs: Inputs, digest: int) -> None:
        payload = pickle.dumps(inputs) if inputs else b""
        self._seq += 1
        header = torch.tensor([self._seq, kind, skey, len(payload), digest], dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group.control)
        if payload:
            dist.broadcast(
                torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, group=self.group.control
            )
        self._last = time.monotonic()

    def _heartbeat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S / 4)
            with self._lock:
                if self._stopped or not self.group.health.ok:
                    return
                if time.monotonic() - self._last < HEARTBEAT_S:
                    continue
                inputs, self._pending = self._pending, Inputs()
                try:
                    self._send(HEARTBEAT, 0, inputs, 0)
                except Exception as exc:
                    self.group.down(f"a heartbeat to the other ranks failed: {type(exc).__name__}: {exc}")
                    return


def message_cost_us(group: Group, rounds: int = 200) -> float:
    """Microseconds until every rank has one step's header when nothing is new: the latency a
    driven step adds (every rank calls this together; the benches report it). Measured as rounds
    of broadcast + barrier less rounds of barrier alone, so back-to-back sends cannot pipeline."""
    header = torch.zeros(HEADER, dtype=torch.int64)

    def timed(send: bool) -> float:
        dist.barrier(group=group.control)
        t0 = time.perf_counter()
        for _ in range(rounds):
            if send:
                dist.broadcast(header, 0, group=group.control)
            dist.barrier(group=group.control)
        return (time.perf_counter() - t0) / rounds

    return max(timed(True) - timed(False), 0.0) * 1e6


def follow(
    group: Group,
    new_bank: Callable[[int, bool], SessionBank],
    new_scheduler: Callable[[SessionBank, int, int], Scheduler],
    tokenizer: Tokenizer,
) -> None:
    """The loop of every rank but 0: apply rank 0's inputs, run the same step, until STOP.
    ``new_bank(budget bytes, disk)`` and ``new_scheduler(bank, max_running, max_batch_tokens)``
    make what rank 0 announces (``runtime.follow``)."""
    banks: dict[int, object] = {}
    scheds: dict[int, Scheduler] = {}
    turns: dict[int, weakref.ref] = {}
    seq = 0
    header = torch.empty(HEADER, dtype=torch.int64)
    while True:
        dist.broadcast(header, 0, group=group.control)
        got, kind, skey, nbytes, digest = header.tolist()
        seq += 1
        if got != seq:
            raise Diverged(f"control message {got} arrived, expected {seq}")
        inputs = Inputs()
        if nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            dist.broadcast(buf, 0, group=group.control)
            inputs = pickle.loads(buf.numpy().tobytes())
        for what, key in inputs.drops:
            (banks if what == "bank" else scheds).pop(key, None)
        for key, budget, disk in inputs.banks:
            banks[key] = new_bank(budget, disk)
        for key, bank_key, max_running, max_batch_tokens in inputs.schedulers:
            scheds[key] = new_scheduler(banks[bank_key], max_running, max_batch_tokens)
        if kind == STOP:
            for bank in banks.values():  # the queued block writes, as rank 0's server does
                if getattr(bank, "tier", None) is not None:
                    bank.tier.close()
            dist.barrier(group=group.control)  # see Leader.stop
            return
        if kind == HEARTBEAT:
            continue
        sched = scheds[skey]
        mine = sched.digest()
        if mine != digest:
            step = sched.pipeline.stats.steps + 1
            raise Diverged(f"rank {group.rank} diverged from rank 0 before step {step}")
        for t in inputs.turns:
            history = history_from_spec(t.history, tokenizer)
            req = TurnRequest(t.prompt, t.params, t.max_tokens, t.namespace, t.session, history, n=t.n)
            turns[t.key] = weakref.ref(req)
            sched.submit(req, _drop)
        for tkey in inputs.cancels:
            req = turns.pop(tkey, lambda: None)()
            if req is not None:
                req.cancel.set()
        sched.step()
        if not group.health.ok:  # this rank's step failed: leave, so rank 0 learns at once
            raise RuntimeError(group.health.error)
        if len(turns) > 256:  # forget finished turns now and then
            turns = {k: r for k, r in turns.items() if r() is not None}


def _drop(event: object) -> None:
    """Events of turns on ranks other than 0 go nowhere (rank 0 answers the client)."""
