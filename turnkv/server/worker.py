"""The engine thread: the scheduler's step loop, fed by the HTTP handlers through a queue.

``EngineWorker`` owns one ``Scheduler`` (``turnkv.engine.scheduler``) and runs it on a single
thread: handlers ``submit`` a ``TurnRequest`` (token ids: the handler rendered and tokenized the
prompt in its thread pool, never here) with an ``emit`` callback; the thread moves new
requests into the scheduler, steps while any turn is waiting or running (one forward per step for
all running turns), and blocks on the queue when idle. Every turn's events reach its ``emit`` in
order; events bound for event loops go through ``post`` (``LoopPost``), which this thread
flushes after each step: one loop wake-up a step, not one a token. This module never imports fastapi.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from turnkv.engine.events import Banked, Failed, Forked, TurnRequest
from turnkv.engine.scheduler import Emit, Scheduler
from turnkv.server.loop_post import LoopPost

log = logging.getLogger(__name__)


@dataclass
class Job:
    request: TurnRequest
    emit: Emit


class EngineWorker:
    """A single thread that runs the scheduler over every submitted turn."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.post = LoopPost()  # what the step's emits queued for the handlers' loops, flushed per step
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._stopping = False
        self._lock = threading.Lock()
        self._requests: dict[int, TurnRequest] = {}  # queued and running, for cancel_all
        self._thread = threading.Thread(target=self._loop, name="turnkv-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting) + self._queue.qsize()

    def submit(self, request: TurnRequest, emit: Emit) -> None:
        with self._lock:
            self._requests[id(request)] = request

        left = [1]  # final events still to come: one per choice once it forked

        def deliver(ev) -> None:  # forget the request at its last event
            if isinstance(ev, Forked):
                left[0] += ev.choices - 1
            elif isinstance(ev, (Banked, Failed)):
                left[0] -= 1
                if left[0] <= 0:
                    with self._lock:
                        self._requests.pop(id(request), None)
            emit(ev)

        self._queue.put(Job(request, deliver))

    def cancel_all(self) -> None:
        """Cancel every queued and running turn: each stops at its next token (its answer ends with
        ``finish_reason`` "cancelled") and still banks what it computed. Thread-safe."""
        with self._lock:
            for request in self._requests.values():
                request.cancel.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every turn (``cancel_all``), then stop; wait at most ``timeout`` s for the thread."""
        self.cancel_all()
        self._queue.put(None)
        self._thread.join(timeout=timeout)

    def abort(self, failed: Failed) -> None:
        """End every queued, waiting and running turn with ``failed``, from any thread: steps can
        no longer finish (a rank of the tensor-parallel group died, and this thread may wait in a
        collective for good). A turn the engine thread ends afterwards gets a second final event,
        which nobody reads (a handler stops at the first)."""
        sched = self.scheduler
        for e in [*sched.waiting, *sched.running]:
            e.emit(failed)
        self.post.flush()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is None:  # a stop request: keep it for the engine thread
                self._queue.put(None)
                return
            job.emit(failed)
            self.post.flush()

    def _take(self, job: Job) -> None:
        self.scheduler.submit(job.request, job.emit)

    def _loop(self) -> None:
        try:
            self._steps()
        finally:
            self.post.flush()

    def _steps(self) -> None:
        sched = self.scheduler
        while True:
            try:
                job = self._queue.get(block=not sched.busy)
            except queue.Empty:
                job = False
            while job:
                self._take(job)
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    job = False
            if job is None:
                self._stopping = True
            if self._stopping and not sched.busy:
                return
            try:
                sched.step()
            except Exception:  # never let one step end the worker (a step fails its own turns)
                log.exception("scheduler step failed")
            self.post.flush()
