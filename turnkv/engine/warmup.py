"""Warm-up before ready: representative turns through the real step path, so that every Triton
kernel variant and CUDA graph the scheduler will use is compiled and captured before ``/health``
says ``ok`` (docs/SERVER.md, "Warming up").

It first launches every variant of the fused attention kernels once (``compile_kernels``: which
of them a step meets depends on its company), then drives turns, not kernels or caches: a private bank and a scheduler like the server's
(``Runtime.warm_up`` builds both) run synthetic turns whose arrivals make the steps a server
meets -- prefill chunks of many row counts (aligned and odd: Triton specializes integers by
divisibility), decode batches of every captured batch size, each beside a conversation long
enough to reach the larger key buckets (the split count a decode graph is keyed by), follow-up
chunks of several sizes over histories of every power of two of keys (restored from the bank: a
chunk's split count, and so its combine kernel's variant, follows its keys), mixed steps
of decode rows plus prompt chunks for each captured batch of decode rows (``mixed_groups``),
sampled, logprob and grammar-masked rows; then verify windows driven on the engine directly
(``verify_steps``: drafts cannot be forced through turns), and a step of every mixed graph key
the limits allow that the turns did not meet (``capture_mixed``: the keys are few,
``mixed_keys``). Whatever those steps compile or capture is then in place, and the step graphs
are sealed (``graphs.StepGraphs.seal``): a step past the graphs' limits runs eagerly instead of
capturing while serving. What a serving step still compiles is counted (``jit_watch``).

On a CPU there is no JIT (the C kernels are built at load): one short turn (``smoke``) checks the
path end to end and touches torch's kernels once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from turnkv.attention.segment_table import GRAPH_BATCHES, ROW_BUCKETS, row_bucket
from turnkv.engine.events import Banked, Failed, TurnRequest
from turnkv.engine.jit_watch import WATCH, graph_captures
from turnkv.engine.mixed_keys import key, layout, shapes
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.limits import MAX_WINDOW_ROWS

log = logging.getLogger(__name__)

LONG_CONTEXTS = (4100, 8200, 16400)  # one conversation per key bucket past the first (4096 keys)
NAMESPACE = "turnkv-warmup"  # its own bank anyway; the name only shows in logs


@dataclass
class WarmProgress:
    """Where start-up stands, read by ``/health`` from another thread (plain fields, replaced whole)."""

    state: str = "loading"  # loading | warming | ok | failed
    phase: str = "load"
    done: int = 0  # turns finished in the warm-up
    total: int = 0
    started: float = field(default_factory=time.monotonic)
    error: str | None = None

    def doc(self) -> dict:
        return {
            "phase": self.phase,
            "done": self.done,
            "total": self.total,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "error": self.error,
        }


@dataclass(frozen=True)
class Arrival:
    at: int  # submitted before this step of its phase
    request: TurnRequest


@dataclass
class WarmReport:
    """What the warm-up did (the startup line, ``/health.scheduler.warmup``)."""

    seconds: float = 0.0
    turns: int = 0
    steps: int = 0
    failed: int = 0  # turns that ended in a Failed (logged; the server still starts)
    captures: int = 0  # step graphs captured by the end of it (``graphs.StepGraphs``)
    kernels: int = 0  # attention kernel variants launched up front (``compile_kernels``)
    # mixed graph keys the limits allow (``mixed_keys.shapes``) and how many of them it captured
    mixed_keys: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    # phase -> [steps, graphs captured, Triton kernel variants first used (``jit_watch``)]
    phase_steps: dict[str, list[int]] = field(default_factory=dict)
    note: str = ""
    ram_s: float | None = None  # waited for the RAM tier's pool before it (``Runtime.pin_ram``)
    ram_pin_s: float | None = None  # the pool's pinning, from its start beside the load

    def doc(self) -> dict:
        return {
            "seconds": round(self.seconds, 2),
            "turns": self.turns,
            "steps": self.steps,
            "failed": self.failed,
            "captures": self.captures,
            "kernels": self.kernels,
            "mixed_keys": self.mixed_keys,
            "phases": {k: round(v, 2) for k, v in self.phases.items()},
            "phase_steps": self.phase_steps,
            "note": self.note,
            "ram_s": None if self.ram_s is None else round(self.ram_s, 2),
            "ram_pin_s": None if self.ram_pin_s is None else round(self.ram_pin_s, 2),
        }


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` ids that share no prefix with another seed's (so each turn prefills its own rows)."""
    span = max(1, min(vocab, 32000) - 200)
    return [100 + (seed * 7919 + i * 104729) % span for i in range(n)]


def _turn(n: int, seed: int, vocab: int, answer: int, **kw) -> TurnRequest:
    params = SamplingParams(ignore_eos=True, **kw.pop("sampling", {}))
    return TurnRequest(_prompt(n, seed, vocab), params, max_tokens=answer, namespace=NAMESPACE, **kw)


def _keys(limit: int) -> list[int]:
    """History lengths 64, 128, ... up to ``limit``: one per power of two of the keys read."""
    return [1 << k for k in range(6, 32) if 1 << k <= limit]


def _sizes(limit: int) -> list[int]:
    """Row counts from 1 to ``limit``: each power of two, and one past it."""
    out, p = set(), 1
    while p <= limit:
        out.update(x for x in (p, p + 1) if x <= limit)
        p *= 2
    return sorted(out | {limit})


def _compiles(engine) -> bool:
    """Whether steps JIT-compile kernels or capture graphs here (CUDA: Triton, CUDA graphs)."""
    return engine.shape.device.type == "cuda"


Group = list[Arrival]  # turns driven together until the scheduler is idle again


def plan(sched: Scheduler, grammar=None) -> list[tuple[str, list[Group]]]:
    """The phases of the warm-up for ``sched``'s engine and limits, each a list of groups."""
    engine = sched.engine
    vocab = engine.loaded.config.vocab_size
    if not _compiles(engine):
        return [("smoke", [[Arrival(0, _turn(16, 1, vocab, 2))]])]
    budget, running = sched.max_batch_tokens, sched.max_running
    room = (engine.max_context or 1 << 20) - 16
    seed = iter(range(1, 1 << 30))
    # prompt chunks alone: one turn at a time, so each step has exactly that many rows
    lengths = [*_sizes(budget), budget + 3, 2 * budget + 1]
    prefill = [[Arrival(0, _turn(n, next(seed), vocab, 2))] for n in lengths if n < room]
    # decode batches of each captured size, with short contexts and beside one long conversation
    decode: list[Group] = []
    longs = [n for n in LONG_CONTEXTS if n < room]
    for b in [b for b in GRAPH_BATCHES if b <= running]:
        for long in [0, *longs]:
            group = [_turn(5 + i, next(seed), vocab, 4) for i in range(b - (long > 0))]
            if long:  # the same long prompt every time: the bank restores it after the first
                group.append(_turn(long, 0, vocab, 4))
            decode.append([Arrival(0, r) for r in group])
    # prompt chunks over a history (follow-ups, restored from the bank): a graphed chunk's split
    # count rides in its table, but an eager one's (past a graph's limits) follows the keys it
    # reads, and with it its combine kernel's variant
    history: list[Group] = []
    for h in [h for h in _keys(max(longs, default=0)) if h + budget < room]:
        for r in [2, 8, 16, 40, 200, budget]:
            ids = _prompt(h, 0, vocab) + _prompt(r, next(seed), vocab)
            history.append([Arrival(0, TurnRequest(ids, SamplingParams(ignore_eos=True), 2, NAMESPACE))])
    return [
        ("prefill", prefill),
        ("decode", decode),
        ("history", history),
        ("mixed", mixed_groups(sched, grammar, seed)),
    ]


def mixed_groups(sched: Scheduler, grammar, seed) -> list[Group]:
    """Decode rows beside prompt chunks, for each captured batch of decode rows: ``b`` turns
    decoding (greedy, sampled, logprobs and grammar-masked among them) while prompts arrive one
    every other step, each filling the step to a row bucket (the graph's rows, which its wide
    table's grid is sized for whatever its chunks' sizes), a short one (the narrow table's 32-row grid beside the decode rows) and two
    together (a wide table of two chunks: a head beside another prompt's tail under load).

    Between them they compile what a mixed step runs beside its graph: sampled, logprob and
    grammar-masked rows in company (one and two masked rows), and the mixed keys these steps
    meet; ``capture_mixed`` then captures every other key directly."""
    engine = sched.engine
    vocab = engine.loaded.config.vocab_size
    budget, running = sched.max_batch_tokens, sched.max_running
    groups: list[Group] = []
    for b in sorted({min(b, running - 2) for b in GRAPH_BATCHES if b < budget and running > 2}):
        chunks = [r - b for r in ROW_BUCKETS if r <= budget and r - b > MAX_WINDOW_ROWS and _hot(r, budget)]
        chunks.append(min(17, budget - b))  # a short prompt: a narrow window beside the decode rows
        pair = (budget - b) // 2
        arrivals = len(chunks) + 2
        answer = 2 * arrivals + 8 + (b * 16) // budget  # long enough to decode beside every arrival
        decoders = [_turn(12 + i % 7, next(seed), vocab, answer) for i in range(b)]
        kinds = [{"sampling": {"temperature": 0.8, "top_p": 0.9, "seed": 1}}, {"logprobs": 2}]
        if grammar is not None:  # one masked row, or two (the mask kernel's row count varies)
            kinds += [{"grammar": grammar}] * (1 if b < 8 else 2)
        for i, kw in enumerate(kinds[: max(0, b - 1)]):  # the first decoder stays greedy
            decoders[i + 1] = _turn(12 + i, next(seed), vocab, answer, **kw)
        start = 2 + (b * 19) // budget  # the decoders' prompts are in: they decode from here
        group = [Arrival(0, r) for r in decoders]
        group += [
            Arrival(start + 2 * i, _turn(n, next(seed), vocab, 1)) for i, n in enumerate(chunks) if n > 0
        ]
        at = start + 2 * len(chunks)
        if pair > MAX_WINDOW_ROWS:
            group += [
                Arrival(at, _turn(pair + 3, next(seed), vocab, 1)),
                Arrival(at, _turn(pair - 3, next(seed), vocab, 1)),
            ]
        groups.append(group)
    return groups


def _hot(rows: int, budget: int) -> bool:
    """The row buckets each batch of decode rows is warmed at: the powers of two and the budget's
    (the midpoints are left to the eager path: a capture costs start-up time)."""
    return rows & (rows - 1) == 0 or rows == row_bucket(budget)


def compile_kernels(engine) -> int:
    """Every variant of the fused attention kernels this model can launch, launched once
    (``triton_variants``): which of them a serving step meets depends on its company, which
    turns cannot pin down. Returns the launches (0 off the fused route or off CUDA)."""
    backend = engine.backend
    if not _compiles(engine) or backend.name != "fused":
        return 0
    from turnkv.attention.triton_variants import compile_all

    heads = backend.gqa * backend.kv_heads
    dtype, kv_dtype = engine.loaded.dtype, engine.shape.dtype
    return compile_all(
        heads, backend.kv_heads, backend.head_dim, dtype, kv_dtype, backend.device, backend.fixed
    )


def verify_steps(engine) -> int:
    """Verify windows (context-copy drafts) run as one-row windows in decode graphs: alone in
    their step (``solo``: every row through the one-row GEMV, which compiles per row-count class)
    or beside other conversations' decode rows (a graph per batch and split count, the splits
    sized by conversations, not rows). Drafts come from the model's own output repeating, which
    synthetic turns cannot force, so these steps are driven on the engine directly, over caches
    of their own that are dropped after (nothing is committed). Returns the steps run."""
    from turnkv.engine.step import Window

    if not _compiles(engine) or not getattr(engine.backend, "cuts_verify_windows", False):
        return 0
    vocab = engine.loaded.config.vocab_size
    room = (engine.max_context or 1 << 20) - 64
    steps = 0
    # short contexts, and one past the first key bucket (a lone conversation's split count
    # doubles there; for two or more it no longer changes)
    for context, convs_list in ((64, (1, 2, 4, 8)), (LONG_CONTEXTS[0], (1, 2))):
        if context >= room:
            continue
        caches = [engine.new_cache() for _ in range(max(convs_list))]
        for c, cache in enumerate(caches):
            engine.prefill(cache, _prompt(context, 7000 + c, vocab))
        for convs in convs_list:
            # alone (solo): padded to 2, 4, 8, 16, 32 rows; in company: one verify window beside
            # convs - 1 decode rows, a graph per padded batch
            sizes = (2, 3, 5, 9, 17) if convs == 1 else [b - convs + 1 for b in GRAPH_BATCHES if b > convs]
            for rows in [r for r in sizes if 1 < r <= MAX_WINDOW_ROWS]:
                windows = [Window(caches[0], _prompt(rows, 9000 + rows, vocab), logits=rows)]
                windows += [Window(caches[c], [101 + c]) for c in range(1, convs)]
                engine.warm_step(windows)  # the graph only: the step's logits are not wanted
                steps += 1
        del caches
    return steps


def capture_mixed(sched: Scheduler) -> int:
    """A step of every mixed graph key ``sched``'s limits allow that the turns before did not
    capture (``mixed_keys.layout``), run on the engine directly over caches of its own and not
    committed: so the graphs are sealed with every mixed key in place, and a serving step with
    prompt rows replays (or, past the graphs' limits, runs eagerly: too many windows of a kind,
    too many views, scored rows). Returns the steps run."""
    from turnkv.engine.step import Window

    engine = sched.engine
    graphs = getattr(engine, "graphs", None)
    if not _compiles(engine) or not getattr(graphs, "capture", False):
        return 0
    budget, running = sched.max_batch_tokens, sched.max_running
    vocab, dtype = engine.loaded.config.vocab_size, engine.shape.dtype
    caches: list = []
    steps = 0
    order = sorted(shapes(budget, running), key=lambda s: (s[0], s[1] or (0, 0), s[2] or 0))
    for shape in order:
        parts = layout(shape, budget, running)
        if parts is None or key(graphs.backend, shape, dtype) in graphs.graphs:
            continue
        caches += [engine.new_cache() for _ in range(len(parts) - len(caches))]
        windows = [
            Window(caches[i], _prompt(p.rows, 11000 + i, vocab), logits=p.logits) for i, p in enumerate(parts)
        ]
        engine.warm_step(windows)  # the graph only: the step's logits are not wanted
        steps += 1
    return steps


def warm_up(sched: Scheduler, progress: WarmProgress, grammar=None) -> WarmReport:
    """Run ``plan(sched)`` on ``sched`` (idle, over a bank of its own) to the end of every turn."""
    phases = plan(sched, grammar)
    report = WarmReport()
    progress.total = sum(len(g) for _, groups in phases for g in groups)
    progress.done = 0
    progress.state = "warming"
    t0 = time.perf_counter()

    engine = sched.engine

    def kernels() -> int:
        report.kernels = compile_kernels(engine)
        return 0  # launches, not steps

    def turns(groups: list[Group]):
        return lambda: sum(_drive(sched, group, progress, report) for group in groups)

    work = [("kernels", kernels), *((name, turns(groups)) for name, groups in phases)]
    work += [("verify", lambda: verify_steps(engine)), ("graphs", lambda: capture_mixed(sched))]
    for name, run in work:
        progress.phase = name
        t, captured, compiled = time.perf_counter(), graph_captures(engine), WATCH.compiles
        steps = run()
        report.steps += steps
        report.phases[name] = time.perf_counter() - t
        report.phase_steps[name] = [steps, graph_captures(engine) - captured, WATCH.compiles - compiled]
    graphs = getattr(sched.engine, "graphs", None)
    if graphs is not None:
        report.captures = int(getattr(graphs, "captures", 0))
        report.mixed_keys = mixed_coverage(sched, graphs)
        graphs.seal()  # from here a key not captured runs eagerly: nothing captures while serving
    report.seconds = time.perf_counter() - t0
    report.turns = progress.total
    if report.failed:
        log.warning("warm-up: %d of %d turns failed (see above); serving anyway", report.failed, report.turns)
    return report


def mixed_coverage(sched: Scheduler, graphs) -> dict[str, int]:
    """``{"possible": keys, "captured": of them}``: the mixed graph keys ``sched``'s limits allow
    (``mixed_keys.shapes``) and how many the warm-up captured; the rest run eagerly when met
    (``/health.scheduler.graph_misses``). Empty where steps are not captured."""
    from turnkv.attention.backend import MixedLaunch

    if not getattr(graphs, "capture", False):
        return {}
    possible = shapes(sched.max_batch_tokens, sched.max_running)
    captured = {k for k in graphs.graphs if isinstance(k[2], MixedLaunch)}
    dtype = sched.engine.shape.dtype
    return {
        "possible": len(possible),
        "captured": len(captured & {key(graphs.backend, s, dtype) for s in possible}),
    }


def _drive(sched: Scheduler, arrivals: list[Arrival], progress: WarmProgress, report: WarmReport) -> int:
    pending = sorted(arrivals, key=lambda a: a.at)
    step = 0

    def sink(ev) -> None:
        if isinstance(ev, Failed):
            report.failed += 1
            log.warning("warm-up turn failed: %s: %s", ev.code, ev.message)
        if isinstance(ev, (Banked, Failed)):
            progress.done += 1

    while pending or sched.busy:
        if not sched.busy and pending and pending[0].at > step:
            step = pending[0].at  # nothing runs until the next arrival: skip ahead
        while pending and pending[0].at <= step:
            sched.submit(pending.pop(0).request, sink)
        sched.step()
        step += 1
    return step
