"""``TurnContext``: everything a turn may use of the engine, handed to it once (``Engine.turn_context``).

A ``Turn`` sees the engine only through this record: its limits, the tokenizer, the KV layout
its cache comes from, what admission prices, and the speculation it drafts with. The scheduler
builds one per scheduler, so ``Turn`` can be driven, and tested, without the engine's step path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from turnkv.engine.admission import Footprint

if TYPE_CHECKING:
    from turnkv.engine.context_copy import SpeculationStats, TurnDrafts
    from turnkv.kv.cache import Layout
    from turnkv.tokenizer import Tokenizer


@dataclass(frozen=True)
class TurnContext:
    max_context: int  # 0: no limit
    vocab: int  # prompt ids must be below it
    default_max_tokens: int  # an unset max_tokens (``models/generation.py``)
    prefill_chunk: int  # rows of one prefill window at most
    device: torch.device  # where sampled rows are drawn
    tokenizer: Tokenizer
    layout: Layout  # new and restored caches
    footprint: Footprint  # what a prefill chunk's activations cost (``admission.activation_bytes``)
    drafts: Callable[[Sequence[int]], TurnDrafts | None]  # a turn's drafts over its prompt (None: off)
    draft_stats: SpeculationStats  # decode windows counted, drafted or not
    verify_rows: Callable[[int], int]  # the most rows of a verify window starting at that cache row
