"""KV rows in another dtype than the compute dtype (``--kv-dtype``; a CPU computing in fp32 stores
bf16 rows by default): which dtype is chosen, that every CPU attention path reads bf16 rows as
exactly their fp32 values (a row is rounded once, when stored), and what bf16 rows cost the default
model's logits against fp32 rows."""

from __future__ import annotations

import pytest
import torch

from turnkv.attention.lse import concat_segments
from turnkv.attention.portable import attend_window, portable_route
from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.events import GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler, run_turn
from turnkv.kv.cache import KVWindow, kv_dtype
from turnkv.limits import MAX_WINDOW_ROWS
from turnkv.runtime import load_engine, new_bank

CPU, META = torch.device("cpu"), torch.device("meta")
F32, BF16 = torch.float32, torch.bfloat16


def test_auto_stores_bf16_where_a_cpu_computes_in_fp32():
    assert kv_dtype("auto", F32, CPU) == BF16
    assert kv_dtype("auto", BF16, CPU) == BF16
    assert kv_dtype("float32", F32, CPU) == F32
    assert kv_dtype("float16", F32, CPU) == torch.float16
    assert kv_dtype("auto", F32, META) == F32  # off a CPU: the compute dtype
    assert kv_dtype("bfloat16", BF16, META) == BF16


def test_another_dtype_off_a_cpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"only a CPU stores KV in another dtype; use --kv-dtype auto"):
        kv_dtype("float32", BF16, META)


def views_of(rows: list[int], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(3, n, 16, generator=g).to(BF16), torch.randn(3, n, 16, generator=g).to(BF16))
        for n in rows
    ]


def as_f32(views):
    return [(k.float(), v.float()) for k, v in views]


def torch_route(q: torch.Tensor, views, start: int) -> torch.Tensor:
    """q ``[Hq, M, D]`` by the route a CPU's window over these one-layer views takes in torch ops."""
    w = KVWindow(tuple((k[None], v[None]) for k, v in views), start, q.shape[1])
    return attend_window(portable_route(w, q.dtype, native=False), q, views, 0.25, start)


@pytest.mark.parametrize(
    "m, rows",
    [
        (1, [40, 25, 1]),  # a decode row over two segments and the tail (concat_segments)
        (4, [40, 30]),  # a small verify window
        (MAX_WINDOW_ROWS + 8, [64, 80]),  # a prefill chunk after a segment (the flash kernel)
    ],
)
def test_bf16_rows_read_as_their_fp32_values(m, rows):
    views = views_of(rows)
    q = torch.randn(9, m, 16, generator=torch.Generator().manual_seed(1))
    start = sum(rows) - m
    got = torch_route(q, views, start)
    want = torch_route(q, as_f32(views), start)
    assert got.dtype == F32 and torch.equal(got, want)
    if m == 1:
        assert torch.equal(
            concat_segments(q, views, 0.25, start), concat_segments(q, as_f32(views), 0.25, start)
        )


@pytest.mark.parametrize("m, t", [(MAX_WINDOW_ROWS + 4, MAX_WINDOW_ROWS + 4), (1, 50), (40, 90)])
def test_one_view_reads_bf16_rows_as_their_fp32_values(m, t):
    (k, v), q = views_of([t])[0], torch.randn(9, m, 16, generator=torch.Generator().manual_seed(2))
    got = torch_route(q, [(k, v)], t - m)  # t == m: a first chunk, torch's SDPA
    assert got.dtype == F32 and torch.equal(got, torch_route(q, [(k.float(), v.float())], t - m))


def test_an_engine_stores_half_the_bytes_and_reports_the_dtype():
    ours = load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32"))
    fp32 = load_engine(EngineConfig(model="random:test", device="cpu", dtype="float32", kv_dtype="float32"))
    assert (ours.info.kv_dtype, ours.info.dtype, fp32.info.kv_dtype) == ("bfloat16", "float32", "float32")
    assert 2 * ours.shape.bytes_per_row == fp32.shape.bytes_per_row
    assert ours.info.fingerprint != fp32.info.fingerprint  # disk-tier keys never mix the two
    cache = ours.new_cache()
    win = cache.open_window(3)
    assert all(k.dtype == BF16 and v.dtype == BF16 for k, v in win.views)


# The default model (dequantized fp32 weights, so only the KV rows differ), bf16 rows against fp32
# rows, every position's logits (2-core VM, torch 2.13): max |difference| 0.22 over a 709-token
# prompt and 0.23 over 1384 tokens, at logits up to 42; a row's max 0.06 at the median; argmax
# equal at every position. (A bf16 row is its fp32 value within 2**-9 relative; the packed
# weights' bf16 activations move the same logits more: tests/test_quant_default.py.) The bound has
# 2x room over what was measured; greedy answers must agree.
LOGIT_TOL = 0.5


@pytest.fixture(scope="module")
def engines(default_model):
    return {kv: Engine(default_model, EngineConfig(kv_dtype=kv)) for kv in ("float32", "bfloat16")}


def last_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    from turnkv.engine.step import Window

    cache = engine.new_cache()
    for at in range(0, len(ids), 256):  # prefill chunks, then the last rows read every chunk
        chunk = ids[at : at + 256]
        res = engine.run_step([Window(cache, chunk, logits=len(chunk))])
        cache.commit(chunk)
    return res.of(0)[-16:].float()


def test_bf16_rows_move_the_default_models_logits_within_the_bound(engines):
    tok = engines["float32"].tokenizer
    text = "The history of cartography is the story of how people described the world. " * 45
    ids = tok.apply_chat_template([{"role": "user", "content": text + "Summarize it."}])
    assert len(ids) > 600
    a, b = (last_logits(engines[kv], ids) for kv in ("float32", "bfloat16"))
    diff = (a - b).abs().max().item()
    assert a.abs().max() > 10 and diff < LOGIT_TOL, f"max |logit difference| {diff}"
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_default_prompt_answers_alike(engines):
    answers = {}
    for kv, engine in engines.items():
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
        )
        req = TurnRequest(list(ids), SamplingParams(), max_tokens=24, namespace="paris")
        bank = new_bank(engine, "256M")
        answers[kv] = "".join(
            e.text for e in run_turn(Scheduler(engine, bank, max_running=1), req) if isinstance(e, GenEvent)
        )
    assert answers["bfloat16"] == answers["float32"] and "Paris" in answers["float32"]
