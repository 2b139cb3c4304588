"""Follow-ups behind first turns, through the real scheduler in process, timed in steps (issue 31).

``--clients`` closed-loop conversations on one ``Scheduler`` (no HTTP): client ``i`` starts at step
``i * --stagger``; each sends a first turn of ``--doc-tokens`` new rows, then ``--rounds - 1``
follow-ups (its whole history, banked, plus ``--user-tokens`` new rows), each ``--answer-tokens``
long, the next one submitted at the step after the last one's ``Banked``. So first turns keep
arriving beside the others' follow-ups. Reports the time to first token of first turns and of
follow-ups, p50/p99, in **steps** (from the step it was submitted at to the step that chose its
first token: the scheduler's decision alone, whatever the machine's load) and in seconds, and out
tok/s. The budget: ``--budget N`` fixed rows a step (``--max-batch-tokens N``), or ``auto`` as a
CPU runs it (the ceiling every step, no ITL target: ``AdaptiveBudget`` over a flat curve).

    python bench/follow_ups.py                      # random:test, 8 clients, 4 rounds, D 3000
    python bench/follow_ups.py --model default --doc-tokens 1500 --budget auto

Prints a table, writes ``bench/out/<tag>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import random
import time

from capacity import pct
from report import save

from turnkv.config import EngineConfig
from turnkv.engine.budget import AdaptiveBudget, FixedBudget, StepCurve
from turnkv.engine.events import Banked, Failed, GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.runtime import load_engine, new_bank


class Client:
    """One conversation: its history's ids, and its turns' submit and first-token times."""

    def __init__(self, i: int, args, vocab: int) -> None:
        self.rng = random.Random(i)
        self.vocab = vocab
        self.start = i * args.stagger
        self.history: list[int] = []
        self.round = 0
        self.turns: list[dict] = []
        self.events: list = []

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def submit(self, sched: Scheduler, args, step: int) -> None:
        self.round += 1
        new = self.ids(args.doc_tokens if self.round == 1 else args.user_tokens)
        self.history += new
        req = TurnRequest(list(self.history), SamplingParams(ignore_eos=True), args.answer_tokens)
        self.events = []
        sched.submit(req, self.events.append)
        self.turns.append({"round": self.round, "step": step, "t": time.perf_counter(), "first": None})

    def take(self, step: int) -> bool:
        """Read this step's events; True when the turn ended (banked)."""
        turn, ended = self.turns[-1], False
        for ev in self.events:
            if isinstance(ev, GenEvent) and ev.token_id is not None:
                if turn["first"] is None:
                    turn |= {"first": step, "ttft_steps": step - turn["step"] + 1}
                    turn["ttft_s"] = time.perf_counter() - turn["t"]
                self.history.append(ev.token_id)
            elif isinstance(ev, Failed):
                raise SystemExit(f"a turn failed: {ev.message}")
            elif isinstance(ev, Banked):
                ended = True
        self.events.clear()
        return ended


def run(args) -> dict:
    cfg = EngineConfig(model=args.model, device="cpu", prefill_chunk=args.prefill_chunk, speculate="off")
    engine = load_engine(cfg)
    if args.budget == "auto":  # a CPU's auto: the ceiling every step (no ITL target)
        budget = AdaptiveBudget(StepCurve((16, 512), (1.0, 32.0)), 512, None, 16, relative=False)
    else:
        budget = FixedBudget(int(args.budget))
    sched = Scheduler(engine, new_bank(engine, args.bank), max_running=64, max_batch_tokens=budget)
    clients = [Client(i, args, engine.turn_context().vocab) for i in range(args.clients)]
    step, t0, busy = 0, time.perf_counter(), set()
    while any(c.round < args.rounds or id(c) in busy for c in clients):
        for c in clients:
            if id(c) not in busy and c.round < args.rounds and step >= c.start:
                c.submit(sched, args, step)
                busy.add(id(c))
        sched.step()
        for c in clients:
            if id(c) in busy and c.take(step):
                busy.discard(id(c))
        step += 1
    wall = time.perf_counter() - t0
    turns = [t for c in clients for t in c.turns]
    first = [t for t in turns if t["round"] == 1]
    follow = [t for t in turns if t["round"] > 1]
    stat = lambda ts, k: {"p50": pct([t[k] for t in ts], 50), "p99": pct([t[k] for t in ts], 99)}  # noqa: E731
    return {
        "args": vars(args),
        "steps": step,
        "wall_s": wall,
        "out_tok_s": len(turns) * args.answer_tokens / wall,
        "first_steps": stat(first, "ttft_steps"),
        "follow_steps": stat(follow, "ttft_steps"),
        "first_s": stat(first, "ttft_s"),
        "follow_s": stat(follow, "ttft_s"),
        "turns": [{k: t[k] for k in ("round", "step", "ttft_steps", "ttft_s")} for t in turns],
    }


def _plot(r: dict, plt, path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for rnd, label in ((1, "first turns"), (2, "follow-ups")):
        xs = sorted(t["ttft_steps"] for t in r["turns"] if (t["round"] == 1) == (rnd == 1))
        ax.plot(xs, [i / len(xs) for i in range(len(xs))], label=label)
    ax.set(xlabel="TTFT, steps", ylabel="fraction", title=f"budget {r['args']['budget']}: {r['steps']} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:test")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=3000)
    ap.add_argument("--user-tokens", type=int, default=40)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--stagger", type=int, default=12, help="steps between the clients' starts")
    ap.add_argument("--budget", default="512", help="fixed rows a step, or auto (a CPU's)")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--bank", default="2G")
    ap.add_argument("--tag", default="follow_ups")
    args = ap.parse_args()
    r = run(args)
    f = lambda d: f"{d['p50']:.3g} / {d['p99']:.3g}"  # noqa: E731
    print(
        f"{args.model}, budget {args.budget}: {r['steps']} steps, {r['wall_s']:.1f} s, out {r['out_tok_s']:.1f} tok/s; "
        f"TTFT p50 / p99: first turns {f(r['first_steps'])} steps ({f(r['first_s'])} s), "
        f"follow-ups {f(r['follow_steps'])} steps ({f(r['follow_s'])} s)"
    )
    save(r, args.tag, _plot)


if __name__ == "__main__":
    main()
