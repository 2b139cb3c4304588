"""What a grammar costs per decoded token, against unconstrained decoding, in the scheduler.

``B`` turns decode together; in one run none is constrained (``ignore_eos``, so each decodes its
``--gen`` tokens), in the other every one decodes under a JSON schema whose output cannot end
before ``--gen`` tokens (a long array of records with strings, integers, an enum and a boolean:
the mask work of real structured output). Both runs take the same prompts, the same number of
steps and the same path (bank, scheduler, step, sampler), alternately ``--repeat`` times in one
process. Timed: the wall time of each step in which all ``B`` turns decode. Reported: ms per step
and tokens/s for both (the least disturbed run of each), the slowdown as the median over repeats of
the paired ratio (a repeat runs both modes on the same prompts; the goal: at most 5 % slower at
batch 32 on the H200) and as the ratio of the minima, and the
grammar's own host time per step (filling the bitmasks; applying them).

The vocabulary matters: ``--vocab 128256`` gives the model the synthetic 128K tokenizer of
``grammar_vocab`` (the default model's tokens plus concatenations), since a random-weight model
has only a byte tokenizer, whose 259 tokens would make masks unrealistically cheap.

    python bench/grammar.py --device cpu --batch 1,8 --gen 48                    # the default model
    python bench/grammar.py --shape llama3-8b --device cuda --vocab 128256 --tokenizer .bench-tok --batch 1,32 --gen 128

Prints a table; writes bench/out/<tag>.json/.png.
"""

from __future__ import annotations

from turnkv.threads import prepare_env

prepare_env()  # OpenMP spins briefly (as the CLI sets it), before torch loads

import argparse
import random
import statistics
import time
from dataclasses import replace

import torch
from grammar_vocab import default_tokenizer, synthetic
from report import save

from turnkv.chat_format.grammar import Grammars
from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.events import Failed, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler
from turnkv.models.load import load_model
from turnkv.runtime import new_bank, run_ahead

RECORDS = {
    "type": "array",
    "minItems": 10000,  # never complete within --gen tokens: every turn decodes all of them
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "name": {"type": "string", "minLength": 3, "maxLength": 24},
            "team": {"enum": ["red", "green", "blue"]},
            "note": {"type": "string", "maxLength": 40},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "team", "note", "active"],
        "additionalProperties": False,
    },
}
PROMPT = "List the members of the club as a JSON array of records with id, name, team, note and active."


def make_engine(args) -> Engine:
    """The engine: the default model, or random weights of ``--shape`` with the default tokenizer
    (``--vocab`` larger than it: the synthetic vocabulary of that size)."""
    spec = f"random:{args.shape}" if args.shape else args.model
    cfg = EngineConfig(
        model=spec, device=args.device, dtype=args.dtype, no_disk=True, max_running=max(args.batches)
    )
    loaded = load_model(spec, args.device, args.dtype, progress=False)
    if args.shape:
        width = loaded.config.vocab_size
        base = default_tokenizer(args.tokenizer)
        tok = synthetic(base, args.vocab or width) if (args.vocab or width) > base.vocab_size else base
        cfg_model = replace(
            loaded.config, eos_token_ids=tuple(sorted(tok.eos_token_ids)), bos_token_id=tok.bos_token_id
        )
        loaded = replace(loaded, tokenizer=tok, config=cfg_model)
    return Engine(loaded, cfg)


def run(
    engine: Engine,
    grammars: Grammars | None,
    batch: int,
    gen: int,
    warmup: int,
    seed: int,
    prefetch: bool = True,
) -> dict:
    """One batch of ``batch`` turns; the timed steps are those where all of them decode.
    ``prefetch``: masks filled ahead on a thread (``StepMasks.start``) or in the step."""
    grammar = grammars.json_schema(RECORDS) if grammars is not None else None
    tok = engine.tokenizer
    rng = random.Random(seed)
    sched = Scheduler(
        engine, new_bank(engine, "auto"), max_running=batch, run_ahead=run_ahead(engine.cfg, engine)
    )
    sched.pipeline.masks.prefetch = prefetch
    failed: list[Failed] = []
    for i in range(batch):
        ids = tok.encode(f"{PROMPT} (list {rng.randrange(10**6)}, part {i})")
        params = SamplingParams(temperature=0.0, ignore_eos=grammar is None)
        sched.submit(
            TurnRequest(ids, params, max_tokens=warmup + gen, grammar=grammar),
            lambda e: isinstance(e, Failed) and failed.append(e),
        )
    steps, wall, fill0, apply0 = 0, 0.0, sched.pipeline.masks.fill_s, sched.pipeline.masks.apply_s
    decoded = 0
    while sched.busy:
        all_decode = len(sched.running) == batch and all(e.turn.phase == "decode" for e in sched.running)
        done_before = min((e.turn.stats.completion_tokens for e in sched.running), default=0)
        if all_decode and done_before >= warmup:
            if steps == 0:
                fill0, apply0 = sched.pipeline.masks.fill_s, sched.pipeline.masks.apply_s
            t0 = time.perf_counter()
            sched.step()
            wall += time.perf_counter() - t0
            steps += 1
            decoded += batch
        else:
            sched.step()
    assert not failed, failed[0].message
    assert steps, "no step had every turn decoding: raise --gen"
    return {
        "step_ms": wall / steps * 1e3,
        "tok_s": decoded / wall,
        "steps": steps,
        "fill_ms": (sched.pipeline.masks.fill_s - fill0) / steps * 1e3,
        "apply_ms": (sched.pipeline.masks.apply_s - apply0) / steps * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--shape", help="random weights: llama3-8b | qwen3-8b | ... (with the default tokenizer)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--vocab", type=int, default=0, help="with --shape: tokenizer size (default: the logit width)"
    )
    ap.add_argument("--tokenizer", help="a saved tokenizer folder (default: the installed default model's)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--gen", type=int, default=48, help="timed decode tokens per turn")
    ap.add_argument("--warmup", type=int, default=8, help="decode tokens per turn before the timing")
    ap.add_argument("--repeat", type=int, default=2, help="free/constrained pairs per batch (alternating)")
    ap.add_argument("--prefetch", default="on", help="on, off or on,off: masks filled ahead on a thread")
    ap.add_argument("--tag", default="grammar")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batch.split(",")]
    engine = make_engine(args)
    grammars = Grammars(engine.tokenizer, engine.loaded.config.vocab_size)
    grammars.json_schema(RECORDS)  # the tokenizer set-up and the compile happen before any timing
    rows = []
    modes = ["free", *(f"grammar/{p}" for p in args.prefetch.split(","))]
    for b in args.batches:
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for rep in range(args.repeat):
            for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:  # the order rotates
                g = grammars if mode != "free" else None
                runs[mode].append(run(engine, g, b, args.gen, args.warmup, rep, mode != "grammar/off"))
        free = min(runs["free"], key=lambda r: r["step_ms"])  # the least disturbed of each
        for mode in modes[1:]:
            rows.append(_row(b, mode, free, runs["free"], runs[mode]))
    print(
        f"{'batch':>5} {'prefetch':>8} {'free ms/step':>12} {'grammar ms/step':>15} {'slower':>7} {'(minima)':>8} {'fill ms':>8} {'apply ms':>9} {'free tok/s':>10} {'grammar tok/s':>13}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['prefetch']:>8} {r['free_step_ms']:>12} {r['grammar_step_ms']:>15} {r['slowdown_pct']:>6}% "
            f"{r['slowdown_of_minima_pct']:>7}% {r['fill_ms']:>8} {r['apply_ms']:>9} {r['free_tok_s']:>10} {r['grammar_tok_s']:>13}"
        )
    info = {
        "model": engine.info.model_name,
        "device": str(engine.loaded.device),
        "vocab": engine.tokenizer.vocab_size,
        "logits": engine.loaded.config.vocab_size,
        "gen": args.gen,
        "repeat": args.repeat,
        "threads": torch.get_num_threads(),
    }
    save({"rows": rows, **info}, args.tag, plot)


def _row(b: int, mode: str, free: dict, frees: list[dict], cons_runs: list[dict]) -> dict:
    """One batch's figures for one grammar mode against the unconstrained runs."""
    cons = min(cons_runs, key=lambda r: r["step_ms"])
    # each repeat's runs share their prompts (the seed): the median of the pairs' ratios is the
    # figure; the ratio of the minima is reported beside it
    paired = statistics.median(g["step_ms"] / f["step_ms"] for f, g in zip(frees, cons_runs, strict=True))
    return {
        "batch": b,
        "prefetch": mode.split("/")[1],
        "free_step_ms": round(free["step_ms"], 3),
        "grammar_step_ms": round(cons["step_ms"], 3),
        "free_tok_s": round(free["tok_s"], 1),
        "grammar_tok_s": round(cons["tok_s"], 1),
        "slowdown_pct": round((paired - 1) * 100, 1),
        "slowdown_of_minima_pct": round((cons["step_ms"] / free["step_ms"] - 1) * 100, 1),
        "fill_ms": round(cons["fill_ms"], 3),
        "apply_ms": round(cons["apply_ms"], 3),
        "steps": cons["steps"],
        "runs": {"free": frees, mode: cons_runs},
    }


def plot(results: dict, plt, path) -> None:
    rows = results["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["free_step_ms"] for r in rows], 0.4, label="unconstrained")
    ax.bar([i + 0.2 for i in x], [r["grammar_step_ms"] for r in rows], 0.4, label="JSON schema")
    ax.set_xticks(
        list(x),
        [f"batch {r['batch']}, ahead {r.get('prefetch', 'on')}\n{r['slowdown_pct']:+}%" for r in rows],
    )
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{results['model']} on {results['device']}, vocabulary {results['vocab']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
