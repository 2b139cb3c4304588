"""Token choice, one owner: where each window's tokens are chosen (``where``), choosing them, and
handing its turn the chosen tokens (``WindowOutput.tokens``); a turn never sees logits.

Per window, from its turn's sampler and the rows it asked logits for:

- ``ARGMAX``: greedy without a logit bias or penalties (``sampling.SamplingParams.penalized``: a
  penalized greedy turn's row depends on its answer so far, so it is drawn, below). The step's batched argmax is every row's token (a
  grammar's mask is in the logits before it). A window without logits rows (a prefill chunk that
  is not the prompt's last) has nothing chosen.
- ``DEVICE``: one logits row of any other turn (a decode row, the prompt's last chunk). The
  turn's sampler draws it on the device, with the step's other such rows (``draw_rows``), into
  the argmax tensor, so the next step can read it there (run-ahead's ``Window.feed``).
- ``HOST``: a verify window of a sampled turn. Its rows are drawn one by one in order, as decode
  steps would draw them, up to the first that is not the next draft token: each draw advances the
  turn's generator, so a row after a rejected draft must never be drawn, and the window after it
  is known only once these are (the pipeline completes such a step before planning the next).

A draw is the exponential race whichever path asks (``sampling.draw_rows``): a seed gives the same
tokens alone or in company, with run-ahead and speculation on or off.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from turnkv.engine.sampling import Sampler, draw_rows, on_device
from turnkv.engine.step import Window


class Where(enum.Enum):
    ARGMAX = "argmax"
    DEVICE = "device"
    HOST = "host"


def where(sampler: Sampler, w: Window) -> Where:
    """Where ``w``'s tokens are chosen (module docstring)."""
    # the argmax is the greedy token unless a logit_bias or a penalty changes the row; the sampler decided
    # once (``SamplingParams.greedy`` builds a tensor per call)
    if w.logits == 0 or (sampler.greedy and sampler.bias is None and sampler.penalties is None):
        return Where.ARGMAX
    return Where.DEVICE if w.logits == 1 else Where.HOST


def choose_on_device(logits: torch.Tensor, draws: Sequence[tuple[int, Sampler]]) -> torch.Tensor | None:
    """Every row's token on the device: ``logits`` ``[R, V]`` (masked) -> int64 ``[R]``, the argmax
    with each ``(row, sampler)`` of ``draws`` (the ``DEVICE`` windows' rows) drawn in its row, in
    a few launches for all; None when the step asked for no logits."""
    if not logits.shape[0]:
        return None
    chosen = logits.argmax(-1)  # [R]
    if draws:
        rows = on_device([r for r, _ in draws], torch.int64, chosen.device)
        tokens = draw_rows([sp for _, sp in draws], logits.index_select(0, rows))
        chosen.index_copy_(0, rows, tokens)
    return chosen


def window_tokens(sampler: Sampler, w: Window, logits: torch.Tensor, chosen: list[int]) -> list[int]:
    """The tokens ``w``'s turn takes: ``chosen`` (its rows of the step's device choice, on the
    host), or for a ``HOST`` window its rows ``logits`` ``[k, V]`` drawn one by one as far as the
    drafts ``w.tokens[1:]`` match (the correction or, after them all, the bonus ends the list).
    Rows after the answer's end (a stop within the window) may be drawn too: nothing draws from
    that generator again."""
    if where(sampler, w) is not Where.HOST:
        return chosen
    drafts = w.tokens[1:]
    tokens: list[int] = []
    for i in range(w.logits):
        tokens.append(sampler(logits[i]))
        if i == len(drafts) or tokens[-1] != drafts[i]:
            break
    return tokens
