"""The grammar masks of a step: what a turn's grammar state is to the engine (``Constraint``), the
bitmasks of a step's constrained rows (``StepMasks``) and their application to the logits.

Grammars are compiled per request outside the engine (``turnkv.chat_format.grammar``); a turn
gets one as its request's ``grammar`` (a ``TurnGrammar``), starts its own state from it
(``Constraint``) and gives it each token it takes. The library is llguidance: a step fills its
masks with llguidance's matchers (``Constraint.matcher``), outside the GIL.

- ``StepMasks.apply`` runs once per step, after the forward is launched and before the step's
  batched argmax: it fills the bitmask of every constrained row on the host (on CUDA this overlaps
  the forward; several rows are filled by llguidance's threads) and applies them to those rows of
  the step's logits in one batched op (on CUDA one Triton launch, ``mask_kernel.py``), so the
  batched argmax and every sampler see masked rows. Unconstrained rows are not touched.
- ``StepMasks.start`` fills them ahead: once a step's tokens are back, the constrained turns give
  theirs to their grammars first (``Turn.take_early``) and the next step's masks are filled on a
  thread while the turns do the rest of their host work (text, stop strings, events); ``apply``
  then only waits for what is left of it. ``start`` waits until the thread is inside llguidance,
  which runs without the GIL: a thread that must win the GIL back from the engine thread's Python
  to start and to finish is slower than filling in the step (docs/BENCHMARKS.md, "Structured
  output: what a grammar costs", "Masks filled ahead").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Constraint(Protocol):
    """One turn's grammar state. ``accept`` advances it by the token the turn chose (the token was
    drawn from a masked row, so a refusal is a bug: it raises); ``done`` once the grammar ended
    (a stop token accepted); ``matcher`` is the llguidance matcher a step fills its mask from."""

    matcher: Any

    def accept(self, token: int) -> None: ...

    @property
    def done(self) -> bool: ...


class TurnGrammar(Protocol):
    """A compiled grammar as a turn sees it (``TurnRequest.grammar``): a fresh state per turn."""

    def start(self) -> Constraint: ...


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
        which runs without the GIL: a thread that must win the GIL back from the engine thread's
        Python waits up to the interpreter's switch interval (``sys.getswitchinterval()``; module
        doc)."""
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
