"""Context-copy speculation on and off, in one process: decode tokens/s, tokens per forward, and
whether greedy text stayed identical.

Conversations (``bench/spec_prompts.py``, ``--kinds``): ``edit`` (repeat code or an email with
one change: the model's own earlier answer, or pasted text), ``list`` (rewrite a numbered list
with one item replaced) and ``free`` (stories, an explanation: little to copy). Each runs alone
(batch 1; per kind, the tokens/s over all its conversations) and eight of them together in one
scheduler (``--batch 8``: three edits, three lists, two free texts), with ``--speculate off`` and
``auto`` side by side: two schedulers over the same model. On a CPU (``--interleave auto``) their
steps alternate, each timing only its own steps, so a shared machine's load slows both alike. On
CUDA the steps run ahead (a step is launched before the one in flight completes), which a
synchronised per-step timer would undo, so the two sides run one after the other (in alternating
order) and time by the wall clock: a turn's decode time runs from its first token to its last.
``--repeat``: medians of pairs, after one pair that warms up (compiles and captures; not counted).
Per turn: decode tokens/s (its tokens after the first over its decode time), tokens per decode
forward, drafted and accepted tokens; per run: decode tokens/s of the batch. Ratios are on/off.

``--forced``: step timing at a model shape with random weights (``--shape llama3-8b``), labelled
*forced acceptance*: each conversation continues a synthetic history of ``--context`` rows; a
step carries plain one-row windows or verify windows of ``k + 1`` rows, after which ``a`` of the
``k`` drafted rows are kept (the rest rolled back) for the patterns ``full`` (a = k), ``half``
and ``none`` (a = 0). Reports step ms and the tokens/s ratio to plain decode, with one verify
window in the batch and with every window verifying. Random weights accept nothing by
themselves: these figures price verification, they do not measure acceptance.

``--index``: the cost of the draft index (build per token, push and draft per step) over a long
conversation.

    python bench/speculation.py --device cpu --threads 1 --batch 1,8 --max-tokens 256
    python bench/speculation.py --device cuda --batch 1,8 --max-tokens 256 --repeat 2
    python bench/speculation.py --device cuda --shape llama3-8b --forced --context 8192 --batch 1,8

Prints a table, then (``--json``) one JSON object as its last line; writes bench/out/<tag>.json/.png.
Imports nothing of the server (runs on the GPU box without fastapi).
"""

from __future__ import annotations

from turnkv.threads import prepare_env

prepare_env()  # OpenMP spins briefly (as the CLI sets it), before torch loads

import argparse
import copy
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from report import save
from spec_prompts import BATCH_8, CONVERSATIONS, Conversation, by_name, of_kind

from turnkv.config import EngineConfig
from turnkv.engine.context_copy import ContextIndex, Speculation
from turnkv.engine.engine import Engine
from turnkv.engine.events import Failed, GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.engine.step import Window
from turnkv.runtime import load_engine, new_bank, run_ahead

FIRST_TOKENS = 200  # the first answer of a revision (longer ones of this model tend to loop)


def histories(engine: Engine, convs: list[Conversation], max_tokens: int) -> list[list[int]]:
    """Each conversation's timed prompt: the first message, or -- for a revision -- the first
    message, the model's own greedy answer to it (speculation off, untimed) and the follow-up."""
    out = []
    for c in convs:
        messages = [{"role": "user", "content": c.first}]
        if c.follow_up is not None:
            side = Side(engine, [engine.tokenizer.apply_chat_template(messages)], "off", max_tokens)
            while side.sched.busy:
                side.sched.step()
            messages += [
                {"role": "assistant", "content": side.text[0]},
                {"role": "user", "content": c.follow_up},
            ]
        out.append(engine.tokenizer.apply_chat_template(messages))
    return out


# -- real prompts -------------------------------------------------------------------------------
class Side:
    """One mode's scheduler over the prompts, with each turn's share of the timed steps."""

    def __init__(self, engine: Engine, ids: list[list[int]], mode: str, max_tokens: int) -> None:
        self.engine = copy.copy(engine)  # the same model, layout, backend and graphs
        self.engine.speculation = Speculation(mode)  # its own step costs and counters
        self.mode = mode
        ahead = run_ahead(engine.cfg, engine)
        self.sched = Scheduler(self.engine, new_bank(self.engine, "4G"), len(ids), 512, run_ahead=ahead)
        self.text = [""] * len(ids)
        self.stats: list = [None] * len(ids)
        self.turns = []
        for i, prompt in enumerate(ids):
            req = TurnRequest(prompt, SamplingParams(), max_tokens=max_tokens)
            self.turns.append(self.sched.submit(req, lambda ev, i=i: self._emit(i, ev)))
        self.decode_s = [0.0] * len(ids)  # time of the steps each turn decoded in
        self.step_s = 0.0  # all decode steps (the batch's time)
        self.first = [0.0] * len(ids)  # wall clock at each turn's first token and its last
        self.last = [0.0] * len(ids)

    def _emit(self, i: int, ev) -> None:
        if isinstance(ev, Failed):
            raise RuntimeError(f"turn {i} failed: {ev.message}")
        if isinstance(ev, GenEvent):
            now = time.perf_counter()
            self.first[i] = self.first[i] or now
            self.last[i] = now if ev.token_id is not None else self.last[i]
            self.text[i] += ev.text
            self.stats[i] = ev.stats or self.stats[i]

    def run(self) -> None:
        """Every step to the end, timed by the wall clock (``first``/``last``), no synchronising."""
        while self.sched.busy:
            self.sched.step()
        self.decode_s = [b - a for a, b in zip(self.first, self.last, strict=True)]
        self.step_s = max(self.last) - min(self.first)

    def step(self) -> None:
        decoding = [t.phase == "decode" for t in self.turns]
        sync = torch.cuda.synchronize if self.engine.shape.device.type == "cuda" else lambda: None
        sync()
        t0 = time.perf_counter()
        self.sched.step()
        dt = time.perf_counter() - t0
        for i, d in enumerate(decoding):
            self.decode_s[i] += dt if d else 0.0
        self.step_s += dt if any(decoding) else 0.0

    def result(self) -> dict:
        turns = []
        for i, s in enumerate(self.stats):
            turns.append({"text": self.text[i], "tokens": s.completion_tokens,
                          "tok_s": round((s.completion_tokens - 1) / self.decode_s[i], 3),
                          "tokens_per_forward": round((s.completion_tokens - 1) / max(s.decode_forwards, 1), 3),
                          "drafted": s.drafted, "accepted": s.accepted})  # fmt: skip
        decoded = sum(t["tokens"] - 1 for t in turns)
        return {"mode": self.mode, "turns": turns, "tok_s": round(decoded / self.step_s, 3),
                "health": self.engine.speculation.stats.health()}  # fmt: skip


def run_pair(
    engine: Engine, ids: list[list[int]], max_tokens: int, interleave: bool, on_first: bool = False
) -> tuple[dict, dict]:
    """Speculation off and on over the same prompts: with ``interleave`` their steps alternate one
    by one, so a shared, loaded machine slows both alike, and each side times only its own steps;
    else one side runs after the other (``on_first``: which), timed by the wall clock."""
    off, on = Side(engine, ids, "off", max_tokens), Side(engine, ids, "auto", max_tokens)
    if not interleave:
        for side in (on, off) if on_first else (off, on):
            side.run()
        return off.result(), on.result()
    while off.sched.busy or on.sched.busy:
        for side in (off, on):
            if side.sched.busy:
                side.step()
    return off.result(), on.result()


def compare(engine: Engine, name: str, convs: list[Conversation], ids: list[list[int]], args) -> dict:
    """Off and on, interleaved (``--repeat`` times: medians); the ratios and text equality."""
    runs: dict[str, list[dict]] = {"off": [], "auto": []}
    interleave = args.interleave == "on" or (args.interleave == "auto" and engine.shape.device.type == "cpu")
    if not interleave:
        run_pair(engine, ids, args.max_tokens, False)  # warm-up: kernels compiled, graphs captured
    pairs = []  # per pair: tok/s off and on, and graphs captured during it (a capture is ~tens of ms)
    for r in range(args.repeat):
        before = engine.graphs.captures
        off, on = run_pair(engine, ids, args.max_tokens, interleave, on_first=bool(r % 2))
        pairs.append((off["tok_s"], on["tok_s"], engine.graphs.captures - before))
        runs["off"].append(off)
        runs["auto"].append(on)
    off, on = runs["off"][0], runs["auto"][0]
    same = [a["text"] == b["text"] for a, b in zip(off["turns"], on["turns"], strict=True)]

    def med(mode: str, i: int | None = None) -> float:
        return statistics.median(r["tok_s"] if i is None else r["turns"][i]["tok_s"] for r in runs[mode])

    per_turn = []
    for i, conv in enumerate(convs):
        a, b = med("off", i), med("auto", i)
        t = on["turns"][i]
        per_turn.append({"conversation": conv.name, "kind": conv.kind, "off_tok_s": a, "on_tok_s": b, "ratio": round(b / a, 3), "tokens": t["tokens"],
                         "tokens_per_forward": t["tokens_per_forward"], "drafted": t["drafted"],
                         "accepted": t["accepted"], "same_text": same[i]})  # fmt: skip
    agg_off, agg_on = med("off"), med("auto")
    row = {"case": name, "batch": len(convs), "off_tok_s": agg_off, "on_tok_s": agg_on,
           "ratio": round(agg_on / agg_off, 3), "min_turn_ratio": min(t["ratio"] for t in per_turn),
           "tokens_per_forward": on["health"]["tokens_per_forward"],
           "acceptance": on["health"]["acceptance"], "same_text": all(same), "turns": per_turn,
           "texts_on": [t["text"] for t in on["turns"]], "pairs": pairs}  # fmt: skip
    print(f"{name:>16} batch {len(convs)}: off {agg_off:7.2f} tok/s  on {agg_on:7.2f} tok/s  "
          f"x{row['ratio']}  min turn x{row['min_turn_ratio']}  tok/fwd {row['tokens_per_forward']}  "
          f"accept {row['acceptance']}  same text {row['same_text']}  pairs {pairs}", flush=True)  # fmt: skip
    return row


def kind_totals(cases: list[dict]) -> dict:
    """Per kind, decode tokens/s over all its batch-1 conversations (tokens over time), off and on."""
    out: dict = {}
    for c in cases:
        t = c["turns"][0]
        k = out.setdefault(t["kind"], {"tokens": 0, "off_s": 0.0, "on_s": 0.0, "same_text": True})
        k["tokens"] += t["tokens"] - 1
        k["off_s"] += (t["tokens"] - 1) / t["off_tok_s"]
        k["on_s"] += (t["tokens"] - 1) / t["on_tok_s"]
        k["same_text"] &= t["same_text"]
    for kind, k in out.items():
        k.update(off_tok_s=round(k["tokens"] / k["off_s"], 3), on_tok_s=round(k["tokens"] / k["on_s"], 3))
        k["ratio"] = round(k["off_s"] / k["on_s"], 3)
        print(f"{kind:>16} (batch 1, all): off {k['off_tok_s']:7.2f} tok/s  on {k['on_tok_s']:7.2f} tok/s  "
              f"x{k['ratio']}  same text {k['same_text']}", flush=True)  # fmt: skip
    return out


# -- forced acceptance at a model shape ---------------------------------------------------------
def run_forced(engine: Engine, eager: Engine, args) -> list[dict]:
    from decode import synthetic_history

    device = engine.shape.device
    rows = []

    def timed(eng: Engine, caches, sizes, keep) -> float:
        ts = []
        for _ in range(args.steps):
            base = [c.num_tokens for c in caches]
            windows = [Window(c, [1] * m, logits=m) for c, m in zip(caches, sizes, strict=True)]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = eng.run_step(windows)
            res.logits.argmax(-1).tolist()  # the step's one sync, as the scheduler does
            ts.append(time.perf_counter() - t0)
            for c, m, n in zip(caches, sizes, base, strict=True):
                c.commit([1] * min(keep(m), m))  # forced acceptance: the rest is rolled back
                c.trim(n)  # constant context from step to step
        return statistics.median(ts[2:]) if len(ts) > 4 else min(ts)

    for b in [int(x) for x in args.batch.split(",") if x]:
        caches = [engine.restore(synthetic_history(engine, args.context, seed=i)) for i in range(b)]
        for c in caches:
            c.presize(64)
        plain = timed(engine, caches, [1] * b, lambda m: 1)
        plain_eager = timed(eager, caches, [1] * b, lambda m: 1)
        row = {"batch": b, "context": args.context, "plain_ms": round(plain * 1e3, 3),
               "plain_eager_ms": round(plain_eager * 1e3, 3), "verify": []}  # fmt: skip
        for k in (1, 3, 7, 15, 31):
            for who in ("one", "all"):
                sizes = [k + 1] + [1] * (b - 1) if who == "one" else [k + 1] * b
                t = timed(engine, caches, sizes, lambda m: m)
                entry = {"k": k, "verifying": who, "step_ms": round(t * 1e3, 3)}
                for pattern, a in (("full", k), ("half", k // 2), ("none", 0)):
                    tokens = (b - 1 + a + 1) if who == "one" else b * (a + 1)
                    entry[pattern] = round((tokens / t) / (b / plain), 3)  # tokens/s over plain decode
                row["verify"].append(entry)
                print(f"forced acceptance  batch {b} k {k:>2} ({who:>3} verifying): step {t * 1e3:8.3f} ms "
                      f"(plain {plain * 1e3:.3f}, eager {plain_eager * 1e3:.3f})  tok/s vs plain: "
                      f"full x{entry['full']}  half x{entry['half']}  none x{entry['none']}", flush=True)  # fmt: skip
        rows.append(row)
        del caches
    return rows


# -- the index ----------------------------------------------------------------------------------
def index_cost(engine: Engine, n: int) -> dict:
    """Build, push and draft costs of ``ContextIndex`` over an ``n``-token conversation."""
    text = "\n".join(c.first for c in CONVERSATIONS)
    unit = engine.tokenizer.encode(text)
    ids = (unit * (n // len(unit) + 1))[:n]
    t0 = time.perf_counter()
    index = ContextIndex(ids)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    steps = 2000
    for t in unit[:steps] if len(unit) >= steps else (unit * (steps // len(unit) + 1))[:steps]:
        index.push(t)
        index.draft(31)
    step = (time.perf_counter() - t0) / steps
    r = {"tokens": n, "build_ms": round(build * 1e3, 2), "build_us_per_token": round(build / n * 1e6, 3),
         "push_and_draft_us": round(step * 1e6, 2)}  # fmt: skip
    print(f"index over {n} tokens: build {r['build_ms']} ms ({r['build_us_per_token']} us/token); "
          f"push + draft {r['push_and_draft_us']} us per step", flush=True)  # fmt: skip
    return r


# -- main ---------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--shape", help="random weights (with --forced): llama3-8b | qwen3-8b | test")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--kinds", default="edit,list,free")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1, help="off/on runs per case (medians reported)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--interleave", choices=("auto", "on", "off"), default="auto",
                    help="alternate the two sides' steps (auto: on a CPU; see the module doc)")  # fmt: skip
    ap.add_argument("--forced", action="store_true", help="step timing with forced acceptance patterns")
    ap.add_argument("--context", type=int, default=4096, help="history rows per conversation (--forced)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per point (--forced)")
    ap.add_argument("--index-tokens", type=int, default=32768)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--tag", default="speculation")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = f"random:{args.shape}" if args.shape else args.model
    cfg = EngineConfig(model=model, device=args.device, dtype=args.dtype)
    engine = load_engine(cfg, progress=False)
    info = engine.info
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"# {info.model_name} on {info.device} {info.dtype}; attention {info.verdict.route}; graphs "
          f"{info.graphs}; {torch.get_num_threads()} threads; load average {load}")  # fmt: skip
    results: dict = {"device": info.device, "model": info.model_name, "dtype": info.dtype,
                     "attention": info.verdict.route, "graphs": info.graphs, "load_avg_start": load,
                     "threads": torch.get_num_threads(), "max_tokens": args.max_tokens}  # fmt: skip
    results["index"] = index_cost(engine, args.index_tokens)
    if args.forced:
        eager = Engine(engine.loaded, replace(cfg, cuda_graphs="off"))
        results["forced"] = run_forced(engine, eager, args)
    else:
        kinds = [k for k in args.kinds.split(",") if k]
        cases = []
        for b in [int(x) for x in args.batch.split(",") if x]:
            if b == 1:
                for kind in kinds:
                    for conv in of_kind(kind):
                        cases.append(
                            compare(engine, conv.name, [conv], histories(engine, [conv], FIRST_TOKENS), args)
                        )
            else:
                pool = by_name(BATCH_8) if b == 8 else [c for c in CONVERSATIONS if c.kind in kinds]
                convs = (pool * (b // len(pool) + 1))[:b]
                cases.append(
                    compare(engine, f"mixed-{b}", convs, histories(engine, convs, FIRST_TOKENS), args)
                )
        results["cases"] = cases
        results["kinds"] = kind_totals([c for c in cases if c["batch"] == 1])
    results["load_avg_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    save(dict(results), args.tag, _plot)
    if args.json:
        print(json.dumps(results))


def _plot(results: dict, plt, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    if "cases" in results:
        names = [f"{c['case']}\nbatch {c['batch']}" for c in results["cases"]]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [c["off_tok_s"] for c in results["cases"]], 0.4, label="off")
        ax.bar([i + 0.2 for i in x], [c["on_tok_s"] for c in results["cases"]], 0.4, label="auto")
        ax.set_xticks(list(x), names, fontsize=8)
        ax.set(ylabel="decode tokens/s", title=f"speculation, {results['model']} on {results['device']}")
    else:
        for row in results.get("forced", []):
            for who in ("one", "all"):
                v = [e for e in row["verify"] if e["verifying"] == who]
                ax.plot([e["k"] + 1 for e in v], [e["full"] for e in v], "-o",
                        label=f"batch {row['batch']}, {who} verifying, full acceptance")  # fmt: skip
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xscale="log", xlabel="verify window rows", ylabel="tokens/s vs plain decode",
               title=f"forced acceptance, {results['model']} on {results['device']}")  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
