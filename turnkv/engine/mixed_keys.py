"""The graph keys a step with prompt rows can take (``engine.graphs``), from the scheduler's limits.

A mixed step's key is ``(row bucket, logit rows, MixedLaunch, False)``, and its launch follows
from a *shape* alone (``FusedBackend.table_launch``: no context, no chunk size, no conversation
count enters it): the step's row bucket, the narrow table's padded batch and grid rows (1 when
every narrow window is one row, else ``MAX_WINDOW_ROWS``) and the wide table's padded batch. So
the keys a server can meet are the shapes some step within its limits has (``shapes``); the
warm-up reports how many of them it captured (``WarmReport.mixed_keys``).
"""

from __future__ import annotations

from turnkv.attention.backend import MixedLaunch
from turnkv.attention.segment_table import GRAPH_BATCHES, ROW_BUCKETS
from turnkv.limits import MAX_WINDOW_ROWS

Shape = tuple[int, tuple[int, int] | None, int | None]  # (row bucket, narrow (batch, rows), wide batch)


def _fewest(batch: int) -> int:
    """The fewest windows padded to ``batch`` (``padded_batch``: more than half of it)."""
    return 1 if batch == 1 else batch // 2 + 1


def _fits(lo: int, hi: int, narrow: tuple[int, int] | None, wide: int | None, running: int) -> bool:
    """Whether a step of ``lo..hi`` rows over at most ``running`` conversations can have these
    tables. Narrow windows: decode rows, a verify window's one-row windows (at most
    ``MAX_WINDOW_ROWS`` of one conversation) and prompt chunks of 2..32 rows; wide windows:
    prompt chunks of more rows, one conversation each."""
    least = most = convs = 0
    if narrow is not None:
        batch, grid = narrow
        k = _fewest(batch)
        if grid == 1:  # one-row windows only, packed as verify rows as densely as they go
            convs += -(-k // MAX_WINDOW_ROWS)
            least += k
        else:  # one prompt chunk of 2+ rows, the rest one-row windows
            convs += 1 + -(-(k - 1) // MAX_WINDOW_ROWS)
            least += k + 1
        most += batch * grid
    if wide is not None:
        k = _fewest(wide)
        convs += k
        least += (MAX_WINDOW_ROWS + 1) * k
        most += wide * hi
    return convs <= running and least <= hi and most >= lo


def shapes(budget: int, running: int) -> set[Shape]:
    """Every shape of a step with prompt rows of at most ``budget`` rows over at most ``running``
    conversations (each kind of window at most ``GRAPH_BATCHES[-1]``: more runs eagerly)."""
    narrows = [None, *((b, r) for b in GRAPH_BATCHES for r in (1, MAX_WINDOW_ROWS))]
    wides = [None, *GRAPH_BATCHES]
    out: set[Shape] = set()
    below = 0
    for bucket in ROW_BUCKETS:
        if below >= budget:
            break
        for narrow in narrows:
            for wide in wides:
                if narrow is None and wide is None:
                    continue
                if _fits(below + 1, min(bucket, budget), narrow, wide, running):
                    out.add((bucket, narrow, wide))
        below = bucket
    return out


def key(backend, shape: Shape, dtype) -> tuple:
    """The graph key (``StepGraphs.stage``'s) of a step of ``shape``."""
    bucket, narrow, wide = shape
    launch = MixedLaunch(
        None if narrow is None else backend.table_launch(narrow[0], narrow[1], dtype),
        None if wide is None else backend.table_launch(wide, bucket, dtype),
    )
    return (bucket, launch.batch, launch, False)
