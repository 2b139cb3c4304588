"""The graph keys a step with prompt rows can take (``engine.graphs``), from the scheduler's limits,
and a step of each (``layout``), so the warm-up captures them all.

A mixed step's key is ``(row bucket, logit rows, MixedLaunch, False)``, and its launch follows
from a *shape* alone (``FusedBackend.table_launch``: no context, no chunk size, no conversation
count enters it): the step's row bucket, the narrow table's batch class and grid rows (1 when
every narrow window is one row, else ``MAX_WINDOW_ROWS``) and the wide table's batch class
(``segment_table.MIXED_BATCHES``). So the keys a server can meet are the shapes some step within
its limits has (``shapes``); the warm-up captures a step of each (``layout``) and reports how many
it captured (``WarmReport.mixed_keys``).
"""

from __future__ import annotations

from dataclasses import dataclass

from turnkv.attention.backend import MixedLaunch
from turnkv.attention.segment_table import MIXED_BATCHES, ROW_BUCKETS, mixed_fewest
from turnkv.limits import MAX_WINDOW_ROWS

Shape = tuple[int, tuple[int, int] | None, int | None]  # (row bucket, narrow (batch, rows), wide batch)


def _fits(lo: int, hi: int, narrow: tuple[int, int] | None, wide: int | None, running: int) -> bool:
    """Whether a step of ``lo..hi`` rows over at most ``running`` conversations can have these
    tables. Narrow windows: decode rows, a verify window's one-row windows (at most
    ``MAX_WINDOW_ROWS`` of one conversation) and prompt chunks of 2..32 rows; wide windows:
    prompt chunks of more rows, one conversation each."""
    least = most = convs = 0
    if narrow is not None:
        batch, grid = narrow
        k = mixed_fewest(batch)
        if grid == 1:  # one-row windows only, packed as verify rows as densely as they go
            convs += -(-k // MAX_WINDOW_ROWS)
            least += k
        else:  # one prompt chunk of 2+ rows, the rest one-row windows
            convs += 1 + -(-(k - 1) // MAX_WINDOW_ROWS)
            least += k + 1
        most += batch * grid
    if wide is not None:
        k = mixed_fewest(wide)
        convs += k
        least += (MAX_WINDOW_ROWS + 1) * k
        most += wide * hi
    return convs <= running and least <= hi and most >= lo


def _below(bucket: int) -> int:
    i = ROW_BUCKETS.index(bucket)
    return ROW_BUCKETS[i - 1] if i else 0


def shapes(budget: int, running: int) -> set[Shape]:
    """Every shape of a step with prompt rows of at most ``budget`` rows over at most ``running``
    conversations (each kind of window at most ``MIXED_BATCHES[-1]``: more runs eagerly)."""
    narrows = [None, *((b, r) for b in MIXED_BATCHES for r in (1, MAX_WINDOW_ROWS))]
    wides = [None, *MIXED_BATCHES]
    out: set[Shape] = set()
    for bucket in ROW_BUCKETS:
        below = _below(bucket)
        if below >= budget:
            break
        for narrow in narrows:
            for wide in wides:
                if narrow is None and wide is None:
                    continue
                if _fits(below + 1, min(bucket, budget), narrow, wide, running):
                    out.add((bucket, narrow, wide))
    return out


def key(backend, shape: Shape, dtype) -> tuple:
    """The graph key (``StepGraphs.stage``'s) of a step of ``shape``."""
    bucket, narrow, wide = shape
    launch = MixedLaunch(
        None if narrow is None else backend.table_launch(narrow[0], narrow[1], dtype),
        None if wide is None else backend.table_launch(wide, bucket, dtype),
    )
    return (bucket, launch.batch, launch, False)


@dataclass(frozen=True)
class Part:
    """One conversation's window in a step of a given shape: ``rows`` rows asking ``logits`` logit
    rows; ``verify``: a verify window, cut into ``rows`` one-row windows (``step.one_row_windows``)."""

    rows: int
    logits: int = 1
    verify: bool = False


def layout(shape: Shape, budget: int, running: int) -> list[Part] | None:
    """A step of ``shape`` of at most ``budget`` rows over at most ``running`` conversations (the
    warm-up captures its graph), or None when there is none: the fewest windows of each table's
    class, then rows up to the bucket (or the budget). One-row windows are conversations of their
    own while ``running`` allows, the rest verify windows of up to ``MAX_WINDOW_ROWS`` rows."""
    bucket, narrow, wide = shape
    hi = min(bucket, budget)
    lo = _below(bucket) + 1
    chunks: list[int] = []  # narrow prompt chunks (2..32 rows), then one-row windows
    ones = 0
    if narrow is not None:
        batch, grid = narrow
        k = mixed_fewest(batch)
        chunks, ones = ([2], k - 1) if grid > 1 else ([], k)
    wides = [MAX_WINDOW_ROWS + 1] * (mixed_fewest(wide) if wide is not None else 0)
    room = hi - sum(chunks) - ones - sum(wides)
    if room < 0:
        return None
    if wides:  # the wide chunks take the rest of the bucket
        wides[0] += room
    elif narrow is not None and narrow[1] > 1:  # narrow chunks grow to 32 rows, then more of them
        while room > 0:
            if chunks[-1] < MAX_WINDOW_ROWS:
                add = min(room, MAX_WINDOW_ROWS - chunks[-1])
                chunks[-1] += add
                room -= add
            elif len(chunks) + ones < narrow[0] and room >= 2:
                chunks.append(2)
                room -= 2
            else:
                break
    elif narrow is not None:  # one-row windows only: more of them
        add = min(room, narrow[0] - ones)
        ones += add
    total = sum(chunks) + ones + sum(wides)
    if not lo <= total <= hi:
        return None
    parts = [Part(n) for n in wides] + [Part(n) for n in chunks]
    free = running - len(parts)  # conversations left for the one-row windows
    own = min(ones, free)
    while own > 0 and own + -(-(ones - own) // MAX_WINDOW_ROWS) > free:
        own -= 1
    if not wides and not chunks:
        if own == 0:
            return None
        # one-row windows that all ask a logit row are a decode step: one of them is a prompt's
        # row before its last (no logit row), as a prompt cut at one row is
        parts.append(Part(1, logits=0))
        own -= 1
        ones -= 1
    parts += [Part(1) for _ in range(own)]
    left = ones - own
    while left > 0:
        n = min(left, MAX_WINDOW_ROWS)
        parts.append(Part(n, logits=n, verify=True))
        left -= n
    return parts if len(parts) <= running else None
