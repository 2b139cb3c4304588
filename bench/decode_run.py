"""One decode run of ``bench/decode.py``: B conversations restored from a bank and decoding on one
engine's scheduler, timed alone or step for step beside another engine's run (``interleave``).

Why interleave: on a shared CPU (other jobs on its 2 cores) the load changes within seconds, so
two engines timed one after the other compare the machine's moments, not the engines: the
deterministic A/B of issue 33 came out 4-5x apart in either order although the flag changes no
CPU kernel. Alternating single steps, each timed alone, puts both under the same load; the ratio
of each pair's step times is then the comparison (its median, over many pairs).

Why settle: with ``--threads 0`` each CPU engine's thread governor first times decode steps at
every candidate count (``engine.cpu_threads``), some of them far slower beside a busy neighbour
(a spinning 2-thread team). A run is timed only once its governor has chosen, as a server
runs after its first steps.
"""

from __future__ import annotations

import statistics
import time

import torch

from turnkv.engine.engine import Engine
from turnkv.engine.events import TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.kv.segments import SegmentedSnapshot
from turnkv.runtime import new_bank, run_ahead


class DecodeRun:
    """The turns of one run (``histories`` continued by ``args.new`` random prompt tokens and
    ``args.gen`` greedy or seeded tokens), prefilled and warmed up by the constructor."""

    def __init__(self, engine: Engine, histories: list[SegmentedSnapshot], args, ahead_mode: str = "auto"):
        self.engine, self.args = engine, args
        b = self.batch = len(histories)
        # room for the histories, a contiguous copy of each, and the turns' own rows
        held = sum(seg.nbytes for h in histories for seg in h.segments())
        bank = new_bank(
            engine, 2 * held + b * (args.new + args.gen + 64) * engine.shape.bytes_per_row + (1 << 30)
        )
        g = torch.Generator().manual_seed(7)
        vocab = engine.loaded.config.vocab_size
        eos = set(engine.tokenizer.eos_token_ids)
        ahead = {"auto": run_ahead(engine.cfg, engine), "on": True, "off": False}[ahead_mode]
        sched = self.sched = Scheduler(
            engine, bank, max_running=b, max_batch_tokens=b * args.new, run_ahead=ahead
        )
        for i, snap in enumerate(histories):
            bank.insert(f"c{i}", snap)
            new = [
                t if t not in eos else (t + 1) % vocab
                for t in torch.randint(0, vocab, (args.new,), generator=g).tolist()
            ]
            params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=i, ignore_eos=True)
            req = TurnRequest([*snap.tokens, *new], params, max_tokens=args.gen, namespace=f"c{i}")
            sched.submit(req, lambda ev: None)
        while not self.decoding() and sched.busy:
            sched.step()  # admission, restore and the follow-ups' prefill
        used = min(args.warmup, args.gen // 4)
        for _ in range(used):  # graph captures, contiguous first-use copies
            sched.step()
        while engine.threads.probing and self.decoding() and used < args.gen // 2:
            sched.step()  # the thread governor's first probe (module docstring)
            used += 1
        self.settle_steps = used
        self.budget = args.gen - used - 8  # timed steps at most: every turn still decoding
        self.cached = sum(e.turn.stats.cached_tokens for e in sched.running)
        self.steps = 0
        self.step_s: list[float] = []  # each timed step alone (``step``; not the whole loop's)
        self.waited0 = sched.pipeline.stats.wait_s

    def decoding(self) -> bool:
        return bool(self.sched.running) and all(e.turn.phase == "decode" for e in self.sched.running)

    def more(self) -> bool:
        return self.decoding() and self.steps < self.budget

    def step(self) -> None:
        """One step, timed alone (an interleaved run: no run-ahead across the other engine's)."""
        t0 = time.perf_counter()
        self.sched.step()
        if self.engine.shape.device.type == "cuda":
            torch.cuda.synchronize()
        self.step_s.append(time.perf_counter() - t0)
        self.steps += 1

    def timed_loop(self) -> float:
        """The timed steps as one loop, its wall seconds: with run-ahead (CUDA graphs) a step()
        launches one decode step and takes the previous one's tokens, so a sync around each call
        would undo it."""
        device = self.engine.shape.device
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while self.more():
            self.sched.step()
            self.steps += 1
        return time.perf_counter() - t0

    def finish(self, wall_s: float, profile_top: int = 0, host_profile: int = 0) -> dict:
        sched, device = self.sched, self.engine.shape.device
        host = wall_s - (sched.pipeline.stats.wait_s - self.waited0)
        gpu_ms = None
        if device.type == "cuda" and sched.running:
            gpu_ms = profile_gpu_ms(sched, 4, profile_top)
        if device.type != "cuda" and profile_top and sched.running:
            profile_cpu_ops(sched, 4, profile_top)
        if host_profile and sched.running:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(min(8, self.args.gen // 8)):
                sched.step()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(host_profile)
        while sched.busy:
            sched.step()
        median = statistics.median(self.step_s) if self.step_s else None
        return {"steps": self.steps, "wall_s": wall_s, "host_s": host, "gpu_ms": gpu_ms, "cached": self.cached,
                "graph_replays": self.engine.graphs.replays, "run_ahead_steps": sched.pipeline.stats.ahead_steps,
                "settle_steps": self.settle_steps, "median_step_s": median,
                "threads": self.engine.threads.health()}  # fmt: skip


def run_decode(engine: Engine, histories: list[SegmentedSnapshot], args, ahead_mode: str = "auto") -> dict:
    """One engine's run alone, timed as one loop."""
    run = DecodeRun(engine, histories, args, ahead_mode)
    return run.finish(run.timed_loop(), args.profile_top, args.host_profile)


def run_interleaved(runs: list[DecodeRun]) -> tuple[list[dict], list[list[float]]]:
    """The runs' timed steps alternating one by one (each timed alone, in a rotating order, so
    neither always follows the other); their results and each run's step seconds per round."""
    rounds = 0
    while all(r.more() for r in runs):
        for r in runs[rounds % len(runs) :] + runs[: rounds % len(runs)]:
            r.step()
        rounds += 1
    n = min(r.steps for r in runs)
    pairs = [r.step_s[:n] for r in runs]
    return [r.finish(sum(r.step_s)) for r in runs], pairs


def paired_ratio(a: list[float], b: list[float]) -> dict:
    """Speed of ``a`` over ``b`` from paired step times (``b_i / a_i``): median and quartiles."""
    ratios = sorted(y / x for x, y in zip(a, b, strict=True) if x > 0)
    if not ratios:
        return {"median": None, "q1": None, "q3": None, "pairs": 0}
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"median": round(statistics.median(ratios), 4), "q1": round(q[0], 4), "q3": round(q[2], 4),
            "pairs": len(ratios)}  # fmt: skip


def profile_gpu_ms(sched: Scheduler, n: int, top: int = 0) -> float:
    """Kernel time per step over ``n`` steps, from torch.profiler's device times; prints the
    ``top`` kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            if not sched.running:
                break
            sched.step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    for e in events[:top]:
        print(f"    {e.self_device_time_total / n:>9.1f} us/step {e.count // n:>5}x  {e.key[:90]}")
    return sum(e.self_device_time_total for e in events) / 1e3 / n


def profile_cpu_ops(sched: Scheduler, n: int, top: int) -> None:
    """Prints the ``top`` torch ops by self CPU time per step over ``n`` steps (a CPU run)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            if not sched.running:
                break
            sched.step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    for e in events[:top]:
        print(f"    {e.self_cpu_time_total / n / 1e3:>9.2f} ms/step {e.count // n:>6}x  {e.key[:80]}")
