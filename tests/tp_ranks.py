"""What every rank of a test group runs (``turnkv.parallel.spmd.run_group``), and the same program
in one process as the reference (``test_parallel.py``).

``program`` is deterministic (greedy and seeded turns, the same ids on every rank), so the ranks
stay in step without rank 0 sending anything.
"""

from __future__ import annotations

import time

import torch

from turnkv.chat import ChatSession
from turnkv.config import EngineConfig, ModelConfig
from turnkv.engine.engine import Engine
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.step import Window
from turnkv.models.load import SHAPES
from turnkv.runtime import build, load_engine, new_bank

# A second shape that splits over 2: untied embeddings with an odd vocabulary (the last rank's
# padding rows), q/k/v and o biases (o's added on rank 0 only), per-head q/k norms, GQA group 2.
ODD = ModelConfig(
    arch="llama",
    vocab_size=509,
    hidden_size=96,
    intermediate_size=160,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position=2048,
    attention_bias=True,
    qk_norm=True,
)
EXTRA_SHAPES = {"tp-odd": ODD}

PROMPT = [256, *range(40, 77)]  # 38 ids: prefill chunks of 16, 16 and 6 rows


def register() -> None:
    """Make ``random:tp-odd`` loadable in this process."""
    SHAPES.update(EXTRA_SHAPES)


def engine_for(model: str, size: int) -> Engine:
    # shards load dequantized (parallel/shard.py), so the one-process reference does too: packed
    # weights round activations to bf16 (models/quant.py) and would differ by more than fp32 order;
    # fp32 rows for the same reason (bf16 rows, a CPU's default, round such differences to bf16 steps).
    # Run-ahead on, as on GPUs (where graphs turn it on): every rank's scheduler launches each step
    # before the last one's tokens are taken, prompt chunks included (the served test runs without)
    cfg = EngineConfig(
        model=model, device="cpu", dtype="float32", kv_dtype="float32", prefill_chunk=16,
        tensor_parallel=size, weights="dequant", run_ahead="on",
    )  # fmt: skip
    return load_engine(cfg, progress=False)


def step_logits(engine: Engine) -> list[list[float]]:
    """Every logits row of a chunked prefill, then of one step mixing a whole prompt (all rows'
    logits), a decode row and a prefill chunk that asks for none."""
    a, b, c = engine.new_cache(), engine.new_cache(), engine.new_cache()
    rows = [engine.prefill(a, PROMPT)]
    b_ids, c_ids = PROMPT[5:17], PROMPT[3:30]
    windows = [Window(b, b_ids, logits=len(b_ids)), Window(a, [301], 1), Window(c, c_ids, logits=0)]
    res = engine.run_step(windows)
    rows += list(res.logits)
    return torch.stack(rows).tolist()


def conversation(engine: Engine) -> dict:
    """Turns, a fork and an /undo-style rollback through ``ChatSession`` (scheduler, turns, bank):
    the answers' text, the bank's unique bytes and the ids of the segments it holds."""
    bank = new_bank(engine, "64M")
    rt = build(engine.cfg, "chat", engine=engine)
    s = ChatSession(rt, SamplingParams(), max_tokens=10, system="be brief", bank=bank)
    texts = ["".join(s.ask("hello")), "".join(s.ask("and then?"))]
    f = s.fork()
    texts.append("".join(f.ask("a branch")))
    s.undo()  # back one turn: the next prompt restores a shorter prefix of what is banked
    texts.append("".join(s.ask("instead")))
    seeded = ChatSession(rt, SamplingParams(temperature=1.0, seed=7), max_tokens=10, bank=bank)
    texts.append("".join(seeded.ask("roll the dice")))
    segments = sorted({seg.id for e in bank.entries() for seg in e.snapshot.segments()})
    return {
        "texts": texts,
        "unique_bytes": bank.unique_bytes(live=False),
        "segments": segments,
        "hits": bank.stats.hits,
        "cached": s.last.cached_tokens,
    }


def logits_program(group, model: str) -> list[list[float]]:
    """``step_logits`` alone (models without a chat template)."""
    torch.set_num_threads(1)
    return step_logits(engine_for(model, 1 if group is None else group.size))


def program(group, model: str) -> dict:
    """One rank's part (``group`` None: the whole model in this process)."""
    register()
    torch.set_num_threads(1)
    engine = engine_for(model, 1 if group is None else group.size)
    return {
        "kv_heads": engine.shape.num_kv_heads,
        "logits": step_logits(engine),
        "chat": conversation(engine),
    }


def logprobs_program(group, model: str) -> dict:
    """A greedy turn that asks for its prompt's and its answer's logprobs (5 alternatives each):
    the tokens, and each logprob with its alternatives as ``(id, value)``."""
    from turnkv.engine.events import GenEvent, TurnRequest
    from turnkv.engine.scheduler import Scheduler, run_turn

    register()
    torch.set_num_threads(1)
    engine = engine_for(model, 1 if group is None else group.size)
    req = TurnRequest(list(PROMPT), SamplingParams(), max_tokens=6, logprobs=5, prompt_logprobs=5)
    scheduler = Scheduler(engine, new_bank(engine, "64M"), max_running=1)
    events = [e for e in run_turn(scheduler, req) if isinstance(e, GenEvent)]

    def flat(lps) -> list:
        return [[lp.token, lp.logprob, [list(t) for t in lp.top]] for lp in lps]

    return {
        "tokens": [e.token_id for e in events],
        "prompt": flat(events[0].prompt_logprobs),
        "answer": flat([e.logprob for e in events if e.logprob is not None]),
    }


def disk_program(
    group, directory: str, missing_on: int | None, model: str = "random:test", device: str = "cpu"
) -> dict:
    """A turn banked to the disk tier, then the same prompt on a fresh bank (a restart): what it
    restores and answers. ``missing_on``: that rank deletes its copy of the second block first,
    so the group must restore the first block only. (``model``, ``device``: the same on GPUs.)"""
    from turnkv.bank.disk_blocks import block_keys
    from turnkv.engine.events import GenEvent, TurnRequest
    from turnkv.engine.scheduler import Scheduler, run_turn

    torch.set_num_threads(1)
    size = 1 if group is None else group.size
    exact = "float32" if device == "cpu" else "auto"
    cfg = EngineConfig(model=model, device=device, dtype=exact, kv_dtype=exact, prefill_chunk=128,
                       tensor_parallel=size, disk_dir=directory, speculate="off")  # fmt: skip
    engine = load_engine(cfg, progress=False)
    prompt = [256, *((7 * i + 3) % 250 for i in range(599))]  # 600 ids: two whole blocks restorable

    def turn(bank) -> tuple[str, int]:
        req = TurnRequest(list(prompt), SamplingParams(), max_tokens=8, namespace="disk")
        events = [e for e in run_turn(Scheduler(engine, bank, max_running=1), req) if isinstance(e, GenEvent)]
        return "".join(e.text for e in events), events[-1].stats.cached_tokens

    bank = new_bank(engine, "1G", disk=True)
    queue_s = []  # what queueing a turn's blocks costs the engine thread (a host copy under TP)
    write_behind = bank.tier.write_behind

    def timed(*a) -> None:
        t0 = time.perf_counter()
        write_behind(*a)
        queue_s.append(time.perf_counter() - t0)

    bank.tier.write_behind = timed
    cold = turn(bank)
    assert bank.tier.flush(60)  # every queued block written
    written = bank.tier.disk.health()["writes"]
    if missing_on == (0 if group is None else group.rank):
        bank.tier.disk.store.delete(block_keys(bank.tier.disk.context, "disk", prompt, 2)[1])
    bank.tier.close()  # the directory let go, as at a restart
    again = new_bank(engine, "1G", disk=True)
    warm = turn(again)
    tier = again.tier.disk.health()
    again.tier.close()
    return {"cold": cold, "warm": warm, "written": written, "tier": tier, "queue_ms": 1e3 * sum(queue_s)}
