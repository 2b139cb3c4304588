"""The generation loop: restore, chunked prefill, decode windows, stop conditions.

One ``Engine`` owns the model, the KV layout and the attention router. It serves one request at a
time (the server queues the rest). ``generate`` takes a cache that already holds a prefix of the
prompt (from the bank, or empty), prefills the rows the cache lacks in chunks, then decodes. It
never seals: the caller decides when a turn ends (``cache.seal()``) and what to bank.

Every forward is a *window* of query rows over the cache (``forward_window``): a prefill chunk, a
single decode row, or a verify window of up to 32 rows for speculation, which may commit fewer
rows than it computed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from turnkv.config import EngineConfig
from turnkv.engine.sampling import Sampler, SamplingParams
from turnkv.kv import make_layout
from turnkv.kv.cache import KVCache, KVShape, Snapshot, common_prefix_len
from turnkv.models.load import LoadedModel
from turnkv.tokenizer import StreamDecoder


class ContextTooLong(ValueError):
    """The prompt (plus at least one generated token) does not fit the context window."""

    def __init__(self, prompt_tokens: int, max_context: int) -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens but the context window is {max_context} tokens "
            f"(at least one token must be left to generate); shorten the prompt or raise --max-context"
        )
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context


@dataclass
class TurnStats:
    """Figures of one ``generate`` call (reported by ``turnkv generate --json`` and the server)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt rows the cache already held
    prefilled_tokens: int = 0  # prompt rows computed by this call
    completion_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_tok_s: float = 0.0
    forwards: int = 0
    route_counts: dict[str, int] = field(default_factory=dict)


@dataclass
class GenEvent:
    """One step of a generation: a token and the text it made final; the last event carries the end."""

    token_id: int | None
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    stats: TurnStats | None = None


class Engine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig) -> None:
        from turnkv.attention.selfcheck import make_router

        self.loaded = loaded
        self.cfg = cfg
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.fingerprint = loaded.fingerprint
        mc = loaded.config
        self.shape = KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim, loaded.dtype, loaded.device)
        self.layout = make_layout(cfg.kv_layout, self.shape)
        self.router = make_router(
            cfg.attention, loaded.device, mc.head_dim, mc.num_heads, mc.num_kv_heads, loaded.dtype
        )
        self.max_context = (
            min(cfg.max_context or mc.max_position, mc.max_position) if mc.max_position else cfg.max_context
        )
        self.prefill_chunk = max(1, cfg.prefill_chunk)

    @classmethod
    def from_config(cls, cfg: EngineConfig, progress: bool = True) -> Engine:
        from turnkv.models.load import build_random_model, load_model

        if cfg.model.startswith("random:"):
            loaded = build_random_model(cfg.model.split(":", 1)[1], cfg.device, cfg.dtype)
        else:
            loaded = load_model(cfg.model, cfg.device, cfg.dtype, progress=progress, weights=cfg.weights)
        return cls(loaded, cfg)

    # -- caches -------------------------------------------------------------------------------
    def new_cache(self) -> KVCache:
        return self.layout.new()

    def restore(self, snapshot: Snapshot) -> KVCache:
        return self.layout.restore(snapshot)

    def activation_bytes(self, rows: int, history: int = 0) -> int:
        """Transient memory of one prefill chunk of ``rows`` rows over ``history`` cached rows.

        Counts the hidden states and MLP of the chunk and, for the lse route, the fp32 score and
        probability matrices of the largest segment (bounded by the whole history).
        """
        mc = self.loaded.config
        rows = min(rows, self.prefill_chunk)
        item = self.shape.dtype.itemsize
        hidden = rows * (6 * mc.hidden_size + 3 * mc.intermediate_size) * item
        scores = 2 * mc.num_heads * rows * (history + rows) * 4
        logits = mc.vocab_size * 4
        return hidden + scores + logits

    def counters(self) -> dict:
        out = dict(self.layout.counters())
        out["route_counts"] = dict(self.router.route_counts)
        return out

    # -- forward ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_window(self, cache: KVCache, tokens: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Run one window of query rows over the cache; fp32 logits ``[M, V]`` (``[1, V]`` if last_only).

        The caller commits the rows it keeps with ``cache.commit(tokens[:k])``.
        """
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.shape.device)  # [M]
        return self.model(ids, cache, self.router, last_only=last_only)

    def prefill(self, cache: KVCache, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` in chunks; returns the last row's logits ``[V]``."""
        logits = None
        for start in range(0, len(tokens), self.prefill_chunk):
            chunk = tokens[start : start + self.prefill_chunk]
            logits = self.forward_window(cache, chunk, last_only=True)
            cache.commit(chunk)
        assert logits is not None, "prefill needs at least one token"
        return logits[-1]

    # -- generation ---------------------------------------------------------------------------
    def check_context(self, prompt_tokens: int) -> None:
        if self.max_context and prompt_tokens + 1 > self.max_context:
            raise ContextTooLong(prompt_tokens, self.max_context)

    def generate(
        self,
        cache: KVCache,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[GenEvent]:
        """Prefill what the cache lacks of ``prompt_ids``, then decode; see the module docstring."""
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        self.check_context(len(prompt_ids))
        routes_before = dict(self.router.route_counts)
        stats = TurnStats(prompt_tokens=len(prompt_ids))
        t0 = time.perf_counter()

        keep = common_prefix_len(cache.tokens, prompt_ids)
        keep = min(keep, len(prompt_ids) - 1)  # the last prompt row is recomputed for its logits
        if keep < cache.num_tokens:
            cache.trim(keep)
        stats.cached_tokens = keep
        todo = prompt_ids[keep:]
        budget = (
            min(params.max_tokens, self.max_context - len(prompt_ids))
            if self.max_context
            else params.max_tokens
        )
        cache.plan(len(todo) + budget)
        logits = self.prefill(cache, todo)
        stats.prefilled_tokens = len(todo)
        stats.forwards = -(-len(todo) // self.prefill_chunk)
        stats.prefill_s = time.perf_counter() - t0

        sampler = Sampler(params, self.shape.device)
        decoder = StreamDecoder(self.tokenizer)
        stops = StopMatcher(params.stop)
        eos = set() if params.ignore_eos else set(self.tokenizer.eos_token_ids)
        t_first = None
        finish = "length"
        stopped_by_string = False
        n = 0
        while n < budget:
            if should_stop is not None and should_stop():
                finish = "cancelled"
                break
            tok = sampler(logits)
            n += 1
            if t_first is None:
                t_first = time.perf_counter()
                stats.ttft_s = t_first - t0
            if tok in eos:
                finish = "stop"
                yield GenEvent(tok, "")
                break
            text, hit = stops.push(decoder.push(tok))
            yield GenEvent(tok, text)
            if hit:
                finish = "stop"
                stopped_by_string = True
                break
            if n >= budget:
                break
            logits = self.forward_window(cache, [tok])[-1]
            cache.commit([tok])
            stats.forwards += 1
        stats.completion_tokens = n
        t_end = time.perf_counter()
        if t_first is not None:
            stats.decode_s = t_end - t_first
            stats.decode_tok_s = (n - 1) / stats.decode_s if n > 1 and stats.decode_s > 0 else 0.0
        stats.route_counts = {
            k: v - routes_before.get(k, 0)
            for k, v in self.router.route_counts.items()
            if v != routes_before.get(k, 0)
        }
        tail = ""
        if not stopped_by_string:  # text held back for a stop string or a half character is final now
            tail, hit = stops.push(decoder.flush())
            tail += "" if hit else stops.flush()
            finish = "stop" if hit else finish
        yield GenEvent(None, tail, finish_reason=finish, stats=stats)


class StopMatcher:
    """Holds back text that could be the start of a stop string; cuts at the first stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text that is final now, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending = self.pending[:cut], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
