"""Log-probabilities of the chosen tokens, for the turns that ask (``TurnRequest.logprobs``).

Which distribution: the model's, as the step's chooser sees a row before it draws -- the
grammar's mask and the request's ``logit_bias`` applied (``sampling.processed_rows``); the
penalties (which depend on the answer so far), temperature, min-p, top-k and top-p not. That is what the OpenAI API reports (the model's distribution, whatever the
temperature), and a grammar's masked tokens get ``-inf`` (the server writes ``-9999.0``, as vLLM).

Computed on the device in the step's ``finalize`` (``step_logprobs``: one log-softmax of the
asking rows, their top-k and the chosen tokens' values), copied to the host with the chosen
tokens, and split per window in ``complete`` (``StepLogprobs.window``). A step in which no turn
asks builds nothing. A verify window's rows are log-softmaxed one row each, as the decode steps
they stand for would be; the rows of a sampled verify window (``chooser.Where.HOST``: its tokens
are drawn on the host, after this) keep their log-probabilities until ``complete`` picks the drawn
tokens' values from them.

The prompt's tokens (``TurnRequest.prompt_logprobs``: completions' ``echo`` with ``logprobs``):
each prompt chunk of such a turn also asks for the logits of the rows before its prompt tokens
(``step.Window.scores``), and ``prompt_scores`` log-softmaxes those rows on the device in the same
``finalize``, with no mask, bias or penalty (nothing is drawn from them: the model's distribution,
as vLLM's ``prompt_logprobs``), and gathers the prompt token each row is followed by. The first
prompt token has no row before it (its logprob is null, as in OpenAI's and vLLM's answers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from turnkv.engine.sampling import Sampler, on_device, processed_rows


@dataclass(frozen=True)
class TokenLogprob:
    """One answer token's log-probability and its ``top`` alternatives ``(id, logprob)``, most
    likely first (as many as the turn asked for)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Ask:
    """A window whose turn asks for logprobs: its logits rows ``[lo, lo + rows)`` of the step, its
    sampler (the bias), ``top`` alternatives, and whether its tokens are drawn on the host."""

    window: int
    lo: int
    rows: int
    sampler: Sampler | None  # None: a prompt's scoring rows (nothing processes them)
    top: int
    host: bool = False


@dataclass
class StepLogprobs:
    """The asking rows' figures (``A`` rows, windows back to back in ``asks`` order)."""

    asks: list[Ask]
    picked: torch.Tensor  # [A] fp32: the chosen token's logprob (a host window's: filled later)
    top_values: torch.Tensor  # [A, K] fp32, descending
    top_ids: torch.Tensor  # [A, K] int64
    rows: torch.Tensor | None  # [A, V] fp32 log-probabilities, kept only when a host window asks

    def to_host(self) -> None:
        """Start the copies to the host (CUDA: pinned, asynchronous; the step's event follows)."""
        if not self.picked.is_cuda:
            return
        for name in ("picked", "top_values", "top_ids"):
            dev = getattr(self, name)
            host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
            setattr(self, name, host.copy_(dev, non_blocking=True))

    def window(self, i: int, tokens: list[int]) -> list[TokenLogprob] | None:
        """Window ``i``'s figures for ``tokens`` (its rows' chosen tokens, as many as were taken);
        None if its turn did not ask. Call after the step's sync."""
        a0 = 0
        for ask in self.asks:
            if ask.window == i:
                break
            a0 += ask.rows
        else:
            return None
        n = len(tokens)
        if ask.host:  # drawn on the host after finalize: their values are read now
            rows = self.rows[a0 : a0 + n]  # [n, V]
            picked = rows.gather(1, on_device(tokens, torch.int64, rows.device)[:, None])[:, 0].tolist()
        else:
            picked = self.picked[a0 : a0 + n].tolist()
        values = self.top_values[a0 : a0 + n, : ask.top].tolist()
        ids = self.top_ids[a0 : a0 + n, : ask.top].tolist()
        return [
            TokenLogprob(t, lp, tuple(zip(ti, tv, strict=True)))
            for t, lp, ti, tv in zip(tokens, picked, ids, values, strict=True)
        ]


def step_logprobs(logits: torch.Tensor, chosen: torch.Tensor | None, asks: list[Ask]) -> StepLogprobs | None:
    """The figures of the ``asks`` rows of ``logits`` ``[R, V]`` (masked) and ``chosen`` ``[R]``
    (the device's choice: the argmax with the device draws in it); None when nobody asks."""
    if not asks or chosen is None:
        return None
    dev = logits.device
    index = on_device([ask.lo + j for ask in asks for j in range(ask.rows)], torch.int64, dev)  # [A]
    samplers = [ask.sampler for ask in asks for _ in range(ask.rows)]
    lp = torch.log_softmax(processed_rows(samplers, logits.index_select(0, index)), dim=-1)  # [A, V]
    top = torch.topk(lp, max(ask.top for ask in asks), dim=-1)  # [A, K]
    picked = lp.gather(1, chosen.index_select(0, index)[:, None])[:, 0]  # [A]
    keep = lp if any(ask.host for ask in asks) else None
    return StepLogprobs(asks, picked, top.values, top.indices, keep)


def prompt_scores(logits: torch.Tensor, asks: list[tuple[Ask, Sequence[int]]]) -> StepLogprobs | None:
    """The figures of the scoring rows ``asks`` (each with the prompt tokens its rows are followed
    by) of ``logits`` ``[R, V]``, unprocessed; None when no window scores. ``window(i, tokens)``
    then gives window ``i``'s, for ``tokens`` its ``Window.scores``."""
    if not asks:
        return None
    dev = logits.device
    index = on_device([a.lo + j for a, _ in asks for j in range(a.rows)], torch.int64, dev)  # [S]
    targets = on_device([t for _, ts in asks for t in ts], torch.int64, dev)  # [S]
    lp = torch.log_softmax(logits.index_select(0, index), dim=-1)  # [S, V]
    top = torch.topk(lp, max(a.top for a, _ in asks), dim=-1)  # [S, K]
    picked = lp.gather(1, targets[:, None])[:, 0]  # [S]
    return StepLogprobs([a for a, _ in asks], picked, top.values, top.indices, None)
