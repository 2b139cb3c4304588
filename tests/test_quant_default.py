"""The default model (SmolLM2-135M-Instruct, Q4_1 layers, Q8_0 tied embedding) with packed weights
against the same GGUF dequantized to fp32: logits, greedy decisions, the default answer, and the
resident memory of the weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_quant import bf16_yardstick, yardstick_factor

from turnkv.attention.portable import PortableBackend
from turnkv.attention.verdict import Verdict
from turnkv.config import EngineConfig
from turnkv.engine.engine import Engine
from turnkv.engine.events import GenEvent, TurnRequest
from turnkv.engine.sampling import SamplingParams
from turnkv.engine.scheduler import Scheduler, run_turn
from turnkv.engine.step import Window, forward
from turnkv.kv.cache import KVShape
from turnkv.kv.segments import ConversationKV
from turnkv.models import cpu_int4, quant
from turnkv.models.load import default_model_path, load_model
from turnkv.runtime import new_bank

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(quant.kernel_missing() is not None, reason="no int4 CPU kernel in torch"),
]

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Give one tip for learning a language.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
]
# Greedy text is identical for 32 tokens on these; on the others the two paths part at a near-tie
# (measured: tokens 2-26, where the exact model's top two logits are close) -- covered below.
# Logits: where the exact model's top-1 leads by more, the packed model must agree. Measured over
# these prompts' 497 teacher-forced positions: 9 top-1 disagreements with the C kernel (int8
# activations), 14 with torch's int4 kernel, none where the lead was over MARGIN.
MARGIN = 0.5


@pytest.fixture(scope="module")
def models():
    packed = load_model("default", "cpu", "float32", progress=False, weights="auto")
    exact = load_model("default", "cpu", "float32", progress=False, weights="dequant")
    assert packed.weights == "packed", packed.weights_note
    assert packed.matmul == ("c" if cpu_int4.library() is not None else "torch-int4")
    assert exact.matmul == ""
    return packed, exact


@pytest.fixture(scope="module")
def yard():
    return bf16_yardstick(load_model("default", "cpu", "float32", progress=False, weights="dequant"))


def window_logits(loaded, ids: list[int]) -> torch.Tensor:
    cfg = loaded.config
    shape = KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, loaded.dtype, loaded.device)
    window = Window(ConversationKV(shape), list(ids), logits=len(ids))
    return forward(loaded.model, [window], PortableBackend(Verdict(), loaded.model.dtype))[1]


def greedy(engine: Engine, prompt: str, n: int = 32) -> list[int]:
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    events = run_turn(
        Scheduler(engine, new_bank(engine, "1G"), max_running=1),
        TurnRequest(ids, SamplingParams(), max_tokens=n),
    )
    return [ev.token_id for ev in events if isinstance(ev, GenEvent) and ev.token_id is not None]


def test_default_answer_and_greedy_text(models):
    """The default answer says Paris, and the packed model's greedy text is the exact model's up
    to the first position where the exact model's top two logits are within MARGIN (a near-tie
    that rounding activations to bf16 may decide the other way; which prompts meet one moves with
    any change of fp32 summation order, so no prompt is pinned to agree)."""
    packed, exact = models
    ep, ee = Engine(packed, EngineConfig(device="cpu")), Engine(exact, EngineConfig(device="cpu"))
    assert ep.info.weights == {"held": "packed", "note": "self-check ok", "matmul": packed.matmul}
    assert ep.info.fingerprint != ee.info.fingerprint  # their KV rows differ, so do their cache keys
    assert "Paris" in packed.tokenizer.decode(greedy(ep, PROMPTS[0]))
    same = 0
    for prompt in PROMPTS:
        got, want = greedy(ep, prompt), greedy(ee, prompt)
        if got == want:
            same += 1
            continue
        # the first differing token (or where one of them ended: its EOS is not in the list)
        j = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
        )
        ids = ee.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        top2 = window_logits(exact, ids + want[:j])[-1].topk(2).values
        assert float(top2[0] - top2[1]) < MARGIN, (prompt, j, top2.tolist())
    assert same >= len(PROMPTS) // 2, f"only {same} of {len(PROMPTS)} prompts' greedy texts agree"


def test_logits_and_decisions_along_the_exact_continuation(models, yard):
    """Teacher-forced on the exact model's greedy continuation of every prompt: the packed logits
    stay within ``yardstick_factor`` of the bf16 yardstick's distance, and every decision the exact
    model makes by more than MARGIN the packed model makes too."""
    packed, exact = models
    ee = Engine(exact, EngineConfig(device="cpu"))
    for prompt in PROMPTS:
        ids = ee.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        seq = ids + greedy(ee, prompt)
        want = window_logits(exact, seq)
        got = window_logits(packed, seq)
        off = float((got - want).abs().max())
        yard_off = float((window_logits(yard, seq) - want).abs().max())
        assert off <= yardstick_factor(packed) * yard_off, (prompt, off, yard_off)
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > MARGIN
        agree = got.argmax(-1) == want.argmax(-1)
        assert bool(agree[clear].all()), (prompt, (~agree & clear).nonzero().flatten().tolist())


def test_weights_resident_memory_within_one_and_a_half_gguf():
    """Measured in a fresh process: resident memory added by loading the packed default model."""
    code = (
        "import json, torch\n"
        "from turnkv.models.load import load_model\n"
        "def rss():\n"
        "    return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "torch.zeros(8, 8) @ torch.zeros(8, 8)\n"
        "before = rss()\n"
        "lm = load_model('default', 'cpu', 'auto', progress=False)\n"
        "print(json.dumps({'delta': rss() - before, 'weights': lm.weights}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    size = default_model_path().stat().st_size
    assert got["weights"] == "packed"
    assert got["delta"] <= 1.5 * size, f"{got['delta'] / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB GGUF"


def test_cached_equals_uncached_within_tolerance(models, yard):
    """The KV invariant on the packed path: the same tokens run (a) as one window from scratch and
    (b) through the segmented cache in turns (a prompt window, single decode rows, a seal after
    each turn, so later windows attend over several segments) give logits that differ by no more
    than the bf16 yardstick's distance from the exact model, and the same decisions wherever the
    top-1 leads by more than MARGIN. (Greedy *text* equality is pinned on the fp32 path in
    tests/test_engine_equivalence.py: bf16 rounding can flip a near-tie either way.)"""
    packed, exact = models
    eng = Engine(packed, EngineConfig(device="cpu"))
    messages = [{"role": "user", "content": PROMPTS[1]}]
    seq = eng.tokenizer.apply_chat_template(messages)
    cuts = [len(seq)]
    for prompt in PROMPTS[2:5]:
        seq = seq + greedy(eng, PROMPTS[1], 8) + eng.tokenizer.encode(f" {prompt}")
        cuts.append(len(seq))
    whole = window_logits(packed, seq)  # [T, V], one window, no cache reuse
    cache, rows, start = eng.new_cache(), [], 0
    for cut in cuts:
        prompt = seq[start : cut - 4]
        rows.append(eng.run_step([Window(cache, prompt, logits=len(prompt))]).logits)  # the prompt window
        cache.commit(prompt)
        for tok in seq[cut - 4 : cut]:  # then single rows, as decode runs them
            rows.append(eng.run_step([Window(cache, [tok])]).logits)
            cache.commit([tok])
        cache.seal()
        start = cut
    turned = torch.cat(rows)
    assert turned.shape == whole.shape and len(cache.views()) > 1
    want = window_logits(exact, seq)
    yard_off = float((window_logits(yard, seq) - want).abs().max())
    off = float((turned - whole).abs().max())
    assert off <= yardstick_factor(packed) * yard_off, (off, yard_off)
    top2 = whole.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > MARGIN
    assert bool((turned.argmax(-1) == whole.argmax(-1))[clear].all())
