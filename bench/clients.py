"""Concurrent clients through the scheduler, in process: the SGLang multi-turn benchmark's shape.

``N`` clients each hold a conversation of ``R`` rounds; a round is a user message of about ``U``
tokens and an answer of at most ``A`` tokens; every request resends the client's whole history (its
prompt is the chat template over all messages so far) and the next round starts the moment the
answer is complete (no think time). All clients run at once through one ``Scheduler`` -- the
server's engine thread without HTTP, so it runs on the GPU box too. Variants in one run:

- ``batched``: ``--max-running`` turns per step (the server's default);
- ``serial``: ``max_running = 1``, one turn at a time (turnkv before batching);
- ``recompute``: batched, but every request in its own cache namespace, so no history is reused;
- ``plain`` (on request): batched with ``--run-ahead off``, each step's tokens taken before the
  next step is planned: what run-ahead adds;
- any of them with ``+torch`` (``batched+torch``): the CPU decode attention as torch ops instead of
  the C kernel (``turnkv.attention.cpu_native``), to A/B the two in one process.

Per variant: output tokens/s over the whole run, TTFT p50/p90/p99 (submit to first token, the
queue included), inter-token latency p50/p99, prompt rows prefilled per turn (follow-ups apart),
507 refusals.
"""

from __future__ import annotations

import random
import statistics
import time

from turnkv.attention import cpu_native
from turnkv.engine.engine import Engine
from turnkv.engine.events import Failed, GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.runtime import new_bank, run_ahead

WORDS = (
    "river stone lantern orbit copper meadow signal harbor violet engine whisper canyon ledger "
    "marble tide falcon cedar prism quartz ember glacier thicket beacon saddle anchor velvet"
).split()


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


class Client:
    """One conversation: submits its next round when the previous answer is complete."""

    def __init__(self, i: int, engine: Engine, args, salt_rounds: bool) -> None:
        self.i, self.engine, self.args = i, engine, args
        self.salt_rounds = salt_rounds
        self.rng = random.Random(1000 + i)
        self.messages: list[dict] = []
        self.round = 0
        self.turns: list[dict] = []
        self.done = False
        self._text: list[str] = []
        self._stats = None
        self._failed: Failed | None = None

    def user_message(self) -> str:
        """The first words of this client's random stream whose text is ``--user-tokens`` tokens
        or more. Found by bisection over a drawn stretch of words (about 10 encodes instead of one
        per word: the loop that appended a word and re-encoded the whole message took ~1.5 ms of
        the engine thread per batched step of 64 clients on the H200), then the stream is advanced
        by exactly the words used, so every message is the one that loop made."""
        tok, target = self.engine.tokenizer, self.args.user_tokens
        head = f"Client {self.i} round {self.round}."
        state = self.rng.getstate()
        more = [self.rng.choice(WORDS) for _ in range(2 * target + 8)]  # every word is >= 1 token

        def tokens(n: int) -> int:
            return len(tok.encode(" ".join([head, *more[:n]])))

        lo, hi = 0, len(more)  # the fewest words n with tokens(n) >= target (monotone in n)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if tokens(mid) < target else (lo, mid)
        self.rng.setstate(state)
        used = [self.rng.choice(WORDS) for _ in range(lo)]
        return " ".join([head, *used])

    def submit(self, sched: Scheduler) -> None:
        tok = self.engine.tokenizer
        self.messages.append({"role": "user", "content": self.user_message()})
        history = list(self.messages)
        ns = f"c{self.i}" + (f"-r{self.round}" if self.salt_rounds else "")
        req = TurnRequest(
            tok.apply_chat_template(history),
            SamplingParams(ignore_eos=self.args.ignore_eos),
            max_tokens=self.args.answer_tokens,
            namespace=ns,
            render_history=lambda answer: tok.apply_chat_template(
                [*history, {"role": "assistant", "content": answer}], add_generation_prompt=False
            ),
        )
        self._text, self._stats, self._failed = [], None, None
        sched.submit(req, self.emit)

    def emit(self, ev) -> None:
        if isinstance(ev, GenEvent):
            self._text.append(ev.text)
            if ev.finish_reason is not None:
                self._stats = ev.stats
        elif isinstance(ev, Failed):
            self._failed = ev

    def poll(self, sched: Scheduler) -> None:
        """After a step: record a finished round and start the next one."""
        if self._stats is None and self._failed is None:
            return
        if self._failed is not None:
            self.turns.append({"round": self.round, "failed": self._failed.code})
            answer = "(no answer)"
        else:
            s = self._stats
            self.turns.append(
                {
                    "round": self.round,
                    "prompt_tokens": s.prompt_tokens,
                    "cached_tokens": s.cached_tokens,
                    "prefilled": s.prefilled_tokens,
                    "completion_tokens": s.completion_tokens,
                    "ttft_s": s.ttft_s,
                    "gaps_s": list(s.token_gaps_s),
                }
            )
            answer = "".join(self._text)
        self.messages.append({"role": "assistant", "content": answer})
        self.round += 1
        if self.round >= self.args.rounds:
            self.done = True
            self._stats = self._failed = None
        else:
            self.submit(sched)


def run(engine: Engine, variant: str, args, budget: int) -> dict:
    """One variant: every client's ``args.rounds`` rounds; the figures of the module docstring."""
    name, _, kernel = variant.partition("+")
    if not kernel:
        return {**_run(engine, name, args, budget), "variant": variant, "cpu_kernel": "auto"}
    cpu_native.set_enabled(kernel != "torch")
    try:
        out = _run(engine, name, args, budget)
    finally:
        cpu_native.set_enabled(True)
    return {**out, "variant": variant, "cpu_kernel": kernel or "auto"}


def _run(engine: Engine, variant: str, args, budget: int) -> dict:
    bank = new_bank(engine, budget)
    max_running = 1 if variant == "serial" else args.max_running
    ahead = False if variant == "plain" else run_ahead(engine.cfg, engine)  # else as --run-ahead says
    sched = Scheduler(
        engine, bank, max_running=max_running, max_batch_tokens=args.max_batch_tokens, run_ahead=ahead
    )
    clients = [Client(i, engine, args, salt_rounds=variant == "recompute") for i in range(args.clients)]
    t0 = time.perf_counter()
    for c in clients:
        c.submit(sched)
    while not all(c.done for c in clients):
        sched.step()
        for c in clients:
            if not c.done:
                c.poll(sched)
    wall = time.perf_counter() - t0
    turns = [t for c in clients for t in c.turns]
    ok = [t for t in turns if "failed" not in t]
    follow = [t for t in ok if t["round"] > 0]
    gaps = [g for t in ok for g in t["gaps_s"]]
    ttft = [t["ttft_s"] for t in ok]
    out_tokens = sum(t["completion_tokens"] for t in ok)
    return {
        "variant": variant,
        "max_running": max_running,
        "wall_s": round(wall, 3),
        "output_tok_s": round(out_tokens / wall, 2),
        "output_tokens": out_tokens,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(gaps, 50),
        "itl_p99_s": pct(gaps, 99),
        "prefilled_first": statistics.mean(t["prefilled"] for t in ok if t["round"] == 0) if ok else 0,
        "prefilled_follow_up": statistics.mean(t["prefilled"] for t in follow) if follow else 0,
        "follow_up_prompt": statistics.mean(t["prompt_tokens"] for t in follow) if follow else 0,
        "refusals_507": sum(t.get("failed") == "kv_memory_exhausted" for t in turns),
        "failed_other": sum("failed" in t and t["failed"] != "kv_memory_exhausted" for t in turns),
        "steps": sched.pipeline.stats.steps,
        "rows_per_step": round(sched.pipeline.stats.rows / max(sched.pipeline.stats.steps, 1), 1),
        "graph_replays": engine.graphs.replays,
        "run_ahead": sched.pipeline.run_ahead,
        "ahead_steps": sched.pipeline.stats.ahead_steps,
    }


def table(runs: list[dict]) -> None:
    print(
        f"{'variant':>10} | {'tok/s':>8} | {'TTFT p50/p90/p99 s':>20} | {'ITL p50/p99 ms':>15} | "
        f"{'prefill 1st/follow':>18} | {'507':>3} | {'rows/step':>9}"
    )
    for r in runs:
        print(
            f"{r['variant']:>10} | {r['output_tok_s']:>8.1f} | {r['ttft_p50_s']:>6.2f}/{r['ttft_p90_s']:>5.2f}/"
            f"{r['ttft_p99_s']:>6.2f} | {1e3 * r['itl_p50_s']:>6.1f}/{1e3 * r['itl_p99_s']:>7.1f} | "
            f"{r['prefilled_first']:>8.0f}/{r['prefilled_follow_up']:>8.0f} | {r['refusals_507']:>3} | "
            f"{r['rows_per_step']:>9}"
        )
    base = next((r for r in runs if r["variant"] == "serial"), None)
    if base:
        for r in runs:
            print(f"  {r['variant']}: {r['output_tok_s'] / base['output_tok_s']:.2f}x serial output tokens/s")
