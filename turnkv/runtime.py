"""The composition root: every command, server, bench and tensor-parallel rank is assembled here.

``build(cfg, role)`` loads the model into an ``Engine``, resolves every ``auto`` flag and every
consequence of tensor parallelism once into ``Effective``, and wires the parts below it: the
session bank (over the disk tier where the role keeps conversations), the scheduler, and, on
rank 0 of a driven group, the leader that replays each step on the other ranks (a ``StepHook``).
Nothing below this module decides what tensor parallelism turns off, and ``engine/`` never
imports ``parallel/``.

    rt = build(cfg, "serve")          # engine, effective flags, bank over the disk tier, hook
    sched = rt.scheduler()            # limits from cfg, run-ahead and hook from ``rt``
    for ev in rt.run_turn(request):   # one turn on this thread (generate, chat, benches)
        ...
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from turnkv.bank.budget import auto_budget_bytes
from turnkv.bank.session_bank import SessionBank
from turnkv.config import EngineConfig, parse_size
from turnkv.engine.engine import Engine
from turnkv.engine.events import TurnEvent, TurnRequest
from turnkv.engine.scheduler import Scheduler, StepHook, run_turn
from turnkv.kv.segments import unique_bytes

if TYPE_CHECKING:
    from turnkv.engine.budget import StepBudget
    from turnkv.engine.budget_probe import Probe
    from turnkv.engine.warmup import WarmProgress, WarmReport

log = logging.getLogger(__name__)

Role = Literal["serve", "chat", "generate", "bench", "follower"]
KEEPS = ("serve",)  # roles whose bank sits over the RAM and disk tiers (unless --no-ram/--no-disk)


@dataclass(frozen=True)
class Effective:
    """What the flags mean on this engine, decided once (``resolve``); ``None`` reasons: allowed."""

    run_ahead: bool  # --run-ahead (auto: where decode steps replay CUDA graphs)
    speculation_off: str | None  # why --speculate auto drafts nothing
    queue_timeout: float  # s; 0 = none
    grammars_off: str | None  # why constrained decoding (response_format, forced calls) is refused
    weights: str  # how the matrices are held: what the loader was asked for


def speculation_off(tensor_parallel: int) -> str | None:
    """Why context-copy speculation drafts nothing (None: ``auto`` drafts)."""
    if tensor_parallel > 1:  # every rank runs its own scheduler and would time its own steps
        return "tensor parallelism (each rank would size drafts from the step times it measures)"
    return None


def run_ahead(cfg: EngineConfig, engine: Engine) -> bool:
    """``--run-ahead``: ``auto`` is on where decode steps replay CUDA graphs (docs/SCHEDULER.md)."""
    return cfg.run_ahead == "on" or (cfg.run_ahead == "auto" and engine.graphs.status == "on")


def resolve(cfg: EngineConfig, engine: Engine) -> Effective:
    tp = engine.tp.size if engine.tp is not None else 1
    grammars = None
    if tp > 1:  # every rank samples from the gathered logits itself; a grammar's state is not sent
        grammars = (
            "response_format and forced tool calls (tool_choice required or a named function) are not "
            f"supported under --tensor-parallel {tp}; serve on one GPU for constrained decoding"
        )
    return Effective(
        run_ahead=run_ahead(cfg, engine),
        speculation_off=speculation_off(tp),
        # rank 0's clock would decide it, and the other ranks would go on admitting the dropped turn
        queue_timeout=cfg.queue_timeout if tp == 1 else 0.0,
        grammars_off=grammars,
        weights=_weights(cfg),
    )


def _weights(cfg: EngineConfig) -> str:
    return cfg.weights if cfg.tensor_parallel <= 1 else "dequant"  # packed weights are not cut per rank


def load_engine(cfg: EngineConfig, progress: bool = True) -> Engine:
    """The model of ``cfg`` on its device (under ``--tensor-parallel``: this rank's shard)."""
    from functools import partial

    from turnkv.models.llama import LlamaModel
    from turnkv.models.load import build_random_model, load_model

    if cfg.chat_template:
        chat_template(cfg.chat_template)  # a bad one fails before the model loads (the engine uses it)
    empty, init = LlamaModel, LlamaModel.init_random
    if cfg.tensor_parallel > 1:
        from turnkv.parallel.group import current_group, shard_model
        from turnkv.parallel.shard import init_random_shard

        group = current_group()
        if group is None or group.size != cfg.tensor_parallel:
            raise ValueError(
                f"--tensor-parallel {cfg.tensor_parallel} needs a process group of that size: "
                "start it through the turnkv command (or torchrun with as many processes)"
            )
        cfg = replace(cfg, device=str(group.device))
        empty, init = partial(shard_model, group=group), init_random_shard  # this rank's shard
    if cfg.model.startswith("random:"):
        shape = cfg.model.split(":", 1)[1]
        loaded = build_random_model(shape, cfg.device, cfg.dtype, empty=empty, init=init)
    else:
        weights = _weights(cfg)
        loaded = load_model(cfg.model, cfg.device, cfg.dtype, progress=progress, weights=weights, empty=empty)
    return Engine(loaded, cfg, speculation_off=speculation_off(cfg.tensor_parallel))


def chat_template(spec: str) -> str:
    """The text of ``--chat-template``, checked to compile before the model loads."""
    from turnkv.config import ConfigError
    from turnkv.tokenizer import chat_template_text, check_chat_template

    try:
        return check_chat_template(chat_template_text(spec))
    except ValueError as exc:  # ChatTemplateError is one
        raise ConfigError("chat_template", str(exc)) from None


def new_bank(
    engine: Engine, budget: str | int | None = None, disk: bool = False, auto: int | None = None, reserve=None
) -> SessionBank:
    """A session bank of ``budget`` bytes (default ``--bank-bytes``; ``auto``: ``auto`` bytes, or
    ``auto_budget_bytes`` of one process) for ``engine``'s caches; with ``disk``, over the tiers
    (``_open_tiers``: host RAM unless ``--no-ram``, its pool from ``reserve`` when one was started,
    then the disk unless ``--no-disk``)."""
    cfg = engine.cfg
    budget = cfg.bank_bytes if budget is None else budget
    if budget == "auto":
        size = auto if auto is not None else auto_budget_bytes(engine.shape.device)
    else:
        size = parse_size(budget)
    return SessionBank(
        budget_bytes=size,
        bytes_per_row=engine.shape.bytes_per_row,
        measure=lambda held: unique_bytes(*held),
        copy_on_restore=engine.layout.copies_on_restore,
        session_ttl_s=cfg.session_ttl,
        session_share=cfg.session_share,
        tier=_open_tiers(engine, reserve) if disk else None,
    )


def _open_tiers(engine: Engine, reserve=None):
    """The chain behind the bank (``bank.tiers``): the host-RAM tier (``--ram-bytes``; off where
    its pinned memory cannot be had, with the reason on ``/health.ram``) in front of the disk."""
    from turnkv.bank.ram_budget import open_ram
    from turnkv.bank.tiers import TierChain

    disk = None if engine.cfg.no_disk else _open_tier(engine)
    ram, off = open_ram(engine, disk, reserve)
    return TierChain(ram, disk, off)


def _auto_budget(engine: Engine) -> int:
    """``--bank-bytes auto``; under tensor parallelism the smallest rank's, so that every rank's
    bank decides alike (ranks sharing one host's RAM on a CPU split it): a collective, so every
    rank computes it once, in ``build``."""
    device = engine.shape.device
    own = auto_budget_bytes(device)
    if engine.tp is None:
        return own
    if device.type != "cuda":
        own //= engine.tp.group.size
    return engine.tp.group.min_over_ranks(own)


def _open_tier(engine: Engine):
    """The disk tier in ``--disk-dir``: under tensor parallelism one per rank, in a directory of
    its own (its KV heads' shard of every block), whose restores every rank agrees on
    (``DiskTier.agree``). A rank that cannot open its directory fails: the others' banks would
    otherwise decide without it (docs/PARALLEL.md)."""
    from turnkv.bank.disk import open_tier, rank_dir

    cfg, fingerprint, shape = engine.cfg, engine.info.fingerprint, engine.shape
    budget = parse_size(cfg.disk_bytes)
    if engine.tp is None:
        return open_tier(cfg.disk_dir, fingerprint, shape, budget, cfg.disk_store)
    group = engine.tp.group
    where = rank_dir(cfg.disk_dir, group.size, group.rank)
    suffix = where.name  # a shared store keeps each rank's shard apart too
    tier = open_tier(where, fingerprint, shape, budget, cfg.disk_store, suffix, agree=group.agree_min)
    if tier is None:
        raise RuntimeError(
            f"rank {group.rank} cannot use its KV disk cache {where} (see the warning above); "
            "fix --disk-dir or serve with --no-disk"
        )
    return tier


@dataclass
class Runtime:
    """The assembled parts of one process (``build``)."""

    cfg: EngineConfig
    engine: Engine
    effective: Effective
    bank: SessionBank | None  # None for a follower (rank 0 tells it which banks to make)
    hook: StepHook | None  # rank 0 of a driven tensor-parallel group: the other ranks replay steps
    auto_bank_bytes: int  # what ``--bank-bytes auto`` means here (``_auto_budget``)
    warm: WarmReport | None = None  # what ``warm_up`` did (None: it has not run)
    probe: Probe | None = None  # ``--max-batch-tokens auto``'s measurement (``warm_up`` runs it)
    probe_note: str = "auto: not measured (only turnkv serve measures it)"

    def step_budget(self) -> StepBudget:
        """The prompt budget of a new scheduler (``engine.budget``): fixed where
        ``--max-batch-tokens`` gives rows or nothing was measured (``warm_up`` measures it),
        else adaptive over the measured curve, with ``--itl-target-ms``."""
        from turnkv.engine.budget import AdaptiveBudget, FixedBudget

        fixed = self.cfg.batch_tokens()
        if fixed is not None:
            return FixedBudget(fixed)
        if self.probe is None:
            return FixedBudget(self.engine.prefill_chunk, self.probe_note)
        p = self.probe
        ceiling = p.ceiling(self.engine.prefill_chunk)
        # on a CPU a step's cost grows with its rows from the first: an ITL target would cost
        # prefill throughput one for one, so auto sets none there (a given --itl-target-ms applies)
        relative = self.engine.shape.device.type == "cuda"
        floor = min(p.curve.rows[0], ceiling)
        return AdaptiveBudget(p.curve, ceiling, self.cfg.itl_target(), floor, p.seconds, relative, p.cached)

    def new_bank(self, budget: str | int | None = None, disk: bool = False) -> SessionBank:
        return new_bank(self.engine, budget, disk, self.auto_bank_bytes)

    def scheduler(
        self,
        bank: SessionBank | None = None,
        max_running: int | None = None,
        max_batch_tokens: int | None = None,
        run_ahead: bool | None = None,
    ) -> Scheduler:
        """A scheduler over ``bank`` (default: this runtime's), limits as ``cfg`` says unless given
        (``max_batch_tokens``: fixed rows instead of ``step_budget``)."""
        cfg, eff = self.cfg, self.effective
        return Scheduler(
            self.engine,
            bank if bank is not None else self.bank,
            cfg.max_running if max_running is None else max_running,
            self.step_budget() if max_batch_tokens is None else max_batch_tokens,
            eff.queue_timeout,
            run_ahead=eff.run_ahead if run_ahead is None else run_ahead,
            hook=self.hook,
        )

    def warm_up(self, progress: WarmProgress | None = None) -> WarmReport:
        """Compile and capture what serving steps will use (``engine.warmup``) over a bank of its
        own (nothing of it stays in the server's bank or tiers), then mark the process ready
        (``jit_watch.WATCH``: what compiles later is counted). ``--warmup off``, or a driven
        tensor-parallel group (the other ranks would replay the warm-up's turns), skip it."""
        from turnkv.engine.jit_watch import WATCH
        from turnkv.engine.warmup import WarmProgress, WarmReport, warm_up

        progress = progress if progress is not None else WarmProgress()
        report = WarmReport()
        if self.cfg.warmup == "off":
            report.note = "off: --warmup off"
        elif self.hook is not None or self.engine.tp is not None:
            report.note = "off: tensor parallelism (each rank compiles on its first steps)"
        else:
            waited = self.pin_ram(progress)
            self.measure_budget(progress)
            report = warm_up(self.scheduler(self.new_bank()), progress, _warm_grammar(self))
            report.ram_s = waited
            if waited is not None:
                report.ram_pin_s = self.bank.tier.ram.pool.pin_seconds
        WATCH.mark_ready(self.engine)
        self.warm = report
        return report

    def pin_ram(self, progress: WarmProgress | None = None) -> float | None:
        """Wait for the RAM tier's whole pool before the budget probe and the warm-up; the seconds
        waited (None: no RAM tier; the pinning itself began beside the load: ``HostReserve``).
        Registering pages holds the CUDA driver's lock: beside a loaded server it stalled the
        steps and ran at a twentieth of its idle rate, beside a timed step it would skew it."""
        from turnkv.bank.tiers import TierChain

        tier = self.bank.tier if self.bank is not None else None
        if not isinstance(tier, TierChain) or tier.ram is None or tier.ram.pool.whole:
            return None
        if progress is not None:
            progress.phase = "ram"
        t0 = time.perf_counter()
        tier.ram.pool.grow_behind()
        tier.ram.pool.wait_whole()
        return time.perf_counter() - t0

    def measure_budget(self, progress: WarmProgress | None = None) -> None:
        """``--max-batch-tokens auto``: time steps of prompt rows (``engine.budget_probe``) over a
        bank of its own, before the warm-up (which compiles up to the ceiling chosen here). Not
        under tensor parallelism (every rank must decide alike: the budget stays fixed)."""
        from turnkv.engine import probe_cache
        from turnkv.engine.budget_probe import probe, probe_sizes

        if self.cfg.batch_tokens() is not None or self.probe is not None:
            return
        if self.hook is not None or self.engine.tp is not None:
            self.probe_note = "auto: fixed at --prefill-chunk under tensor parallelism (ranks decide alike)"
            return
        if progress is not None:
            progress.phase = "budget"
        room = (self.engine.max_context or 1 << 20) - 8
        sizes = probe_sizes(self.engine.shape.device.type, room)
        most = max(sizes)
        running = max(self.cfg.max_running, -(-most // self.engine.prefill_chunk))
        kept = probe_cache.probe_path(self.engine, running, sizes)  # None: measured every start
        self.probe = probe_cache.load(kept, sizes)
        if self.probe is None:
            self.probe = probe(self.scheduler(self.new_bank(), running, most, run_ahead=False))
            probe_cache.save(kept, self.probe)

    def run_turn(
        self, request: TurnRequest, bank: SessionBank | None = None, interruptible: bool = False
    ) -> Iterator[TurnEvent]:
        """Drive one turn to its end on this thread (``scheduler.run_turn``)."""
        sched = self.scheduler(bank, max_running=1)
        return run_turn(sched, request, interruptible)


def _warm_grammar(rt: Runtime):
    """A JSON grammar for the warm-up's masked rows, where grammars are served (else None)."""
    if rt.effective.grammars_off is not None:
        return None
    try:
        from turnkv.chat_format.grammar import Grammars

        return Grammars(rt.engine.tokenizer, rt.engine.loaded.config.vocab_size).json_object()
    except Exception as exc:  # llguidance missing or the tokenizer unsupported: requests would say so
        log.info("warm-up without a grammar row: %s", exc)
        return None


def triton_cache() -> str:
    """Triton's compile cache beside the KV disk tier and the packed weights
    (``cbuild.cache_home()/triton``), unless ``TRITON_CACHE_DIR`` names one: a restart loads the
    kernels it compiled instead of compiling them again."""
    from turnkv.cbuild import cache_home

    return os.environ.setdefault("TRITON_CACHE_DIR", str(cache_home() / "triton"))


def build(
    cfg: EngineConfig, role: Role = "serve", engine: Engine | None = None, progress: bool = True
) -> Runtime:
    """Assemble ``role``'s parts (``engine``: reuse a loaded one, as tests and benches do)."""
    from turnkv.bank.ram_budget import start_reserve

    triton_cache()
    # the RAM tier's pool is pinned beside the load and the self-check (``HostReserve``)
    reserve = start_reserve(cfg) if engine is None and role in KEEPS else None
    try:
        engine = engine if engine is not None else load_engine(cfg, progress)
    except BaseException:
        if reserve is not None:
            reserve.close()
        raise
    if engine.shape.device.type == "cuda":
        from turnkv.engine.jit_watch import WATCH

        WATCH.install()  # what compiles from here on is counted (after ready: jit_after_ready)
    hook = None
    group = engine.tp.group if engine.tp is not None else None
    if group is not None and group.driven and group.leader:
        from turnkv.parallel.control import Leader

        group.driver = group.driver or Leader(group)  # one leader per group, whatever it serves
        hook = group.driver
    auto = _auto_budget(engine)
    bank = None if role == "follower" else new_bank(engine, cfg.bank_bytes, role in KEEPS, auto, reserve)
    return Runtime(cfg, engine, resolve(cfg, engine), bank, hook, auto)


def follow(cfg: EngineConfig) -> None:
    """A rank other than 0: load this rank's shard and replay rank 0's steps until it stops."""
    from turnkv.parallel.control import follow as replay
    from turnkv.parallel.group import current_group

    rt = build(cfg, "follower", progress=False)
    group = current_group()

    def scheduler(bank: SessionBank, max_running: int, max_batch_tokens: int) -> Scheduler:
        return rt.scheduler(bank, max_running, max_batch_tokens)

    replay(group, rt.new_bank, scheduler, rt.engine.tokenizer)
