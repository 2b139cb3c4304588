"""Tensor parallelism on the CPU over gloo: two processes against one.

The shard plan cuts every weight so the ranks' parts put back together are the whole (unit
tests); two ranks compute the same logits as one process within fp32 tolerance, the same text
through turns, a fork and a rollback, and their banks hold half the bytes each, in segments with
the same ids (``tp_ranks.program`` on every rank); the command line runs a group and refuses
sizes that do not divide the heads, in one line with exit code 2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import tp_ranks
from test_model_parity import make_folder

from turnkv.cli import main
from turnkv.config import ModelConfig
from turnkv.models.llama import LlamaModel
from turnkv.models.load import SHAPES
from turnkv.parallel.shard import ShardPlan, check_divisible, valid_sizes
from turnkv.parallel.spmd import run_group
from turnkv.runtime import load_engine

ROOT = Path(__file__).resolve().parents[1]


# -- the plan -----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["test", "tp-odd"])
def test_the_ranks_parts_put_back_together_are_the_whole(shape):
    cfg = {**SHAPES, **tp_ranks.EXTRA_SHAPES}[shape]
    whole = LlamaModel(cfg, "meta", torch.float32)
    for size in (2,):
        plans = [ShardPlan(r, size, cfg) for r in range(size)]
        parts = [LlamaModel(p.config, "meta", torch.float32) for p in plans]
        shapes = [dict(m.named_parameters()) for m in parts]
        for name, p in whole.named_parameters():
            full = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)
            cut = [plan.take_param(name, full) for plan in plans]
            assert all(c.shape == s[name].shape for c, s in zip(cut, shapes, strict=True)), name
            assert_reassembles(name, full, cut, cfg, size)


def assert_reassembles(name: str, full: torch.Tensor, cut: list[torch.Tensor], cfg, size: int) -> None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("o", "down"):
        assert torch.equal(torch.cat(cut, 1), full)
    elif leaf in ("embed", "lm_head"):
        assert torch.equal(torch.cat(cut)[: cfg.vocab_size], full)
        assert not torch.cat(cut)[cfg.vocab_size :].any()  # the padding rows are zero
    elif leaf in ("qkv", "qkv_bias"):  # q | k | v of every rank, each cut by heads
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q = torch.cat([c[: qd // size] for c in cut])
        k = torch.cat([c[qd // size : (qd + kd) // size] for c in cut])
        v = torch.cat([c[(qd + kd) // size :] for c in cut])
        assert torch.equal(torch.cat([q, k, v]), full)
    elif leaf == "gate_up":
        i = cfg.intermediate_size // size
        assert torch.equal(torch.cat([c[:i] for c in cut] + [c[i:] for c in cut]), full)
    else:
        assert all(c is full for c in cut)  # norms and the o bias: whole on every rank


def test_sizes_that_do_not_divide_the_heads_are_refused_with_the_ones_that_work():
    smol = ModelConfig(  # SmolLM2-135M's shape: 9 heads over 3 KV heads do not split over 2
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64,
    )  # fmt: skip
    assert valid_sizes(smol) == [1, 3]
    with pytest.raises(ValueError, match=r"9 attention heads and 3 KV heads; sizes that work for it: 1, 3"):
        check_divisible(smol, 2, "SmolLM2")
    check_divisible(smol, 3)
    assert valid_sizes(SHAPES["llama3-8b"]) == [1, 2, 4, 8]


def test_the_all_reduce_on_a_cpu_is_gloo_and_a_bad_setting_is_refused(monkeypatch):
    from turnkv.parallel.one_shot import ENV, make_one_shot

    assert make_one_shot(None, torch.device("cpu"), torch.float32) == (None, "gloo")
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match="expected auto or nccl"):
        make_one_shot(None, torch.device("cpu"), torch.float32)


def test_a_group_s_server_has_no_queue_timeout():
    # rank 0's clock would drop a waiting turn that the other ranks go on admitting
    from turnkv.config import EngineConfig
    from turnkv.server.app import Server

    cfg = EngineConfig(model="random:test", device="cpu", dtype="float32", queue_timeout=5.0, no_disk=True)
    from turnkv.runtime import build

    engine = load_engine(cfg)
    assert Server(build(cfg, "serve", engine=engine)).worker.scheduler.queue_timeout == 5.0
    from types import SimpleNamespace

    # as if rank 0 of an undriven group (no leader): the runtime resolves what a group turns off
    group = SimpleNamespace(on_down=[], driven=False, leader=True, size=2, min_over_ranks=lambda n: n)
    engine.tp = SimpleNamespace(group=group, size=2)
    rt = build(cfg, "serve", engine=engine)
    assert rt.effective.grammars_off is not None and rt.effective.speculation_off is not None
    assert Server(rt).worker.scheduler.queue_timeout == 0.0


def test_the_command_refuses_before_loading(capsys, monkeypatch):
    assert main(["generate", "--model", "default", "--tensor-parallel", "2", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SmolLM2-135M-Instruct has 9 attention heads and 3 KV heads" in err[0]
    monkeypatch.setenv("TURNKV_TENSOR_PARALLEL", "2")  # the env twin, refused the same way
    assert main(["generate", "--model", "default", "--prompt", "hi"]) == 2
    assert "sizes that work for it: 1, 3" in capsys.readouterr().err
    monkeypatch.delenv("TURNKV_TENSOR_PARALLEL")
    assert main(["generate", "--model", "random:test", "--tensor-parallel", "0", "--prompt", "hi"]) == 2
    if torch.cuda.device_count() < 2:  # else this would start a group
        args = [
            "generate",
            "--model",
            "random:test",
            "--device",
            "cuda",
            "--tensor-parallel",
            "2",
            "--prompt",
            "hi",
        ]
        assert main(args) == 2
        assert "needs 2 GPUs (one per process), but torch sees" in capsys.readouterr().err


# -- two ranks against one process ---------------------------------------------------------------
@pytest.mark.parametrize("model", ["random:test", "random:tp-odd"])
def test_two_ranks_compute_what_one_process_computes(model, monkeypatch):
    monkeypatch.setitem(SHAPES, "tp-odd", tp_ranks.ODD)
    check_group_against_one_process(model, 2)


def test_two_ranks_report_the_logprobs_of_the_whole_vocabulary():
    """Prompt and answer logprobs under tensor parallelism are a log-softmax of the gathered
    vocabulary (every rank's shard, the last rank's padding row dropped: 509 = 2 x 255 - 1), as
    one process computes them; a padding logit of 0 kept would shift every value by ~1/509."""
    tp_ranks.register()
    one = tp_ranks.logprobs_program(None, "random:tp-odd")
    ranks = run_group(2, "cpu", tp_ranks.logprobs_program, "random:tp-odd", threads=1, timeout_s=300)
    assert ranks[0] == ranks[1]  # every rank reports the same figures
    tp = ranks[0]
    assert tp["tokens"] == one["tokens"] and len(tp["prompt"]) == len(tp_ranks.PROMPT) - 1
    for part in ("prompt", "answer"):
        assert len(tp[part]) == len(one[part]) > 0, part
        for (token, value, top), (token1, value1, top1) in zip(tp[part], one[part], strict=True):
            assert token == token1 and value == pytest.approx(value1, abs=2e-5), part
            assert [v for _, v in top] == pytest.approx([v for _, v in top1], abs=2e-5), part
            assert all(0 <= t < tp_ranks.ODD.vocab_size for t, _ in top), part  # never a padding id


@pytest.mark.parametrize("case", ["qwen2-bias"])
def test_two_ranks_load_their_cut_of_a_hugging_face_folder(case, tmp_path):
    """Each rank reads every safetensors tensor and keeps its rows or columns: q/k/v (and their
    biases) by heads, o and down by input columns, the untied embedding and LM head by rows."""
    make_folder(tmp_path, case)
    one = tp_ranks.logits_program(None, str(tmp_path))
    ranks = run_group(2, "cpu", tp_ranks.logits_program, str(tmp_path), threads=1, timeout_s=300)
    assert ranks[0] == ranks[1]
    tp, ref = torch.tensor(ranks[0]), torch.tensor(one)
    torch.testing.assert_close(tp, ref, rtol=0, atol=1e-5 * ref.abs().max().item())


@pytest.mark.slow
def test_three_ranks_of_the_default_model_compute_what_one_process_computes():
    """SmolLM2-135M's 9 heads / 3 KV heads split over 3: the GGUF loader cuts each tensor
    (q and k unpermuted first) and the answers are the real model's."""
    check_group_against_one_process("default", 3)


def check_group_against_one_process(model: str, size: int) -> None:
    one = tp_ranks.program(None, model)
    ranks = run_group(size, "cpu", tp_ranks.program, model, threads=1, timeout_s=600)
    assert [r["kv_heads"] for r in ranks] == [one["kv_heads"] // size] * size  # each its share of heads
    # every rank ends each step with the same logits (gathered), one process's within fp32 rounding
    assert all(r["logits"] == ranks[0]["logits"] for r in ranks)
    tp, ref = torch.tensor(ranks[0]["logits"]), torch.tensor(one["logits"])
    # fp32 rounding: the row-parallel sums add in another order, layer after layer (30 in SmolLM2)
    torch.testing.assert_close(tp, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    # the same text through turns, a fork, a rollback and a seeded sample
    chats = [r["chat"] for r in ranks]
    assert all(c["texts"] == one["chat"]["texts"] for c in chats)
    assert chats[0]["hits"] == one["chat"]["hits"] and chats[0]["cached"] == one["chat"]["cached"] > 0
    # each rank's bank holds its share of every row, in segments with the same ids
    assert all(c["unique_bytes"] == chats[0]["unique_bytes"] for c in chats)
    assert sum(c["unique_bytes"] for c in chats) == one["chat"]["unique_bytes"] > 0
    assert all(c["segments"] == chats[0]["segments"] for c in chats)


# -- the command line: rank 0 drives the others -------------------------------------------------
GENERATE = ["generate", "--model", "random:test", "--device", "cpu", "--dtype", "float32",
            "--prompt", "Name three rivers.", "--max-tokens", "12", "--json",
            "--temperature", "1.0", "--seed", "11"]  # fmt: skip


@pytest.mark.parametrize("launcher", ["turnkv", "torchrun"])
def test_generate_on_two_ranks_answers_like_one_process(launcher, capsys):
    assert main(GENERATE) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    start = [sys.executable, "-m"]  # turnkv spawns rank 1 itself; torchrun starts both
    if launcher == "torchrun":
        start += ["torch.distributed.run", "--nproc-per-node", "2", "-m"]
    cmd = [*start, "turnkv", *GENERATE, "--tensor-parallel", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    two = json.loads(out.stdout.strip().splitlines()[-1])
    # rank 0 sent the turn, every rank sampled the same seeded tokens from the same logits
    assert two["text"] == one["text"] and two["completion_tokens"] == one["completion_tokens"] == 12


# -- a served group -----------------------------------------------------------------------------
class Served:
    """``turnkv serve --tensor-parallel 2`` on the CPU in a subprocess (rank 0 spawns rank 1)."""

    def __init__(self, log: Path, disk: Path) -> None:
        from turnkv.parallel.launch import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "turnkv", "serve", "--model", "random:test", "--device", "cpu",
               "--tensor-parallel", "2", "--port", str(self.port), "--bank-bytes", "64M",
               "--disk-dir", str(disk)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_for(lambda h: h["status"] == "ok", 180)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=30).json()

    def wait_for(self, cond, seconds: float) -> dict:
        deadline = time.monotonic() + seconds
        while True:
            assert self.proc.poll() is None, "the server exited"
            try:
                h = self.health()
                if cond(h):
                    return h
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not get there in time"
            time.sleep(0.2)

    def chat(self, messages: list[dict], **extra) -> httpx.Response:
        body = {"model": "random:test", "messages": messages, "max_tokens": 8, **extra}
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)

    def rank1_pid(self) -> int:
        """The spawned rank (rank 0's child running multiprocessing's spawn_main)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
        raise AssertionError(f"no spawned rank among {children}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


@pytest.mark.slow
def test_a_served_group_runs_turns_and_refuses_new_ones_once_a_rank_died(tmp_path):
    srv = Served(tmp_path / "serve.log", tmp_path / "disk")
    try:
        msgs = [{"role": "user", "content": "hello"}]
        first = srv.chat(msgs).json()
        answer = first["choices"][0]["message"]["content"]
        follow = srv.chat(
            [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
        )
        assert follow.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # a client that goes away mid-answer: the cancel reaches both ranks at the same step
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "random:test", "messages": msgs, "max_tokens": 2000, "stream": True, "ignore_eos": True,
        }) as r:  # fmt: skip
            for i, _ in enumerate(r.iter_lines()):
                if i == 6:
                    break
        srv.wait_for(lambda h: h["scheduler"]["running"] == 0, 60)
        assert srv.chat(msgs, temperature=1.0).status_code == 200  # still in step: no rank diverged
        h = srv.health()
        # each rank opened a disk tier of its own (rank 1 when rank 0's bank reached it)
        assert h["disk"]["enabled"] and {p.name for p in (tmp_path / "disk").iterdir()} == {
            "tp2-rank0",
            "tp2-rank1",
        }
        assert h["status"] == "ok" and h["tensor_parallel"] == {
            "size": 2, "status": "ok", "dead_ranks": [], "error": None, "all_reduce": "gloo",
        }  # fmt: skip
        srv.log.flush()
        assert f"disk {tmp_path / 'disk'}/tp2-rank* (" in (tmp_path / "serve.log").read_text()  # the banner
        os.kill(srv.rank1_pid(), signal.SIGKILL)
        h = srv.wait_for(lambda h: h["status"] != "ok", 30)
        assert h["status"] == "unavailable" and h["tensor_parallel"]["dead_ranks"] == [1]
        r = srv.chat(msgs)
        assert r.status_code == 503 and r.json()["error"]["code"] == "tensor_parallel_down"
    finally:
        srv.close()


@pytest.mark.parametrize("missing_on", [None, 1])
def test_each_rank_restores_its_shard_of_the_same_blocks_from_disk(tmp_path, missing_on):
    """Two ranks over gloo, each with a disk tier of its own: a turn's blocks are written by both,
    and after a restart the same prompt restores them on both -- or, where rank 1 lost its copy
    of the second block, the first block only, on both (a restore the ranks disagreed on would
    give them different caches). Answers equal one process's, which restores both blocks."""
    one = tp_ranks.disk_program(None, str(tmp_path / "one"), None)
    ranks = run_group(2, "cpu", tp_ranks.disk_program, str(tmp_path / "tp"), missing_on, timeout_s=600)
    assert one["cold"][1] == 0 and one["warm"] == (one["cold"][0], 512) and one["written"] == 2
    assert sorted(p.name for p in (tmp_path / "tp").iterdir()) == ["tp2-rank0", "tp2-rank1"]
    want = 256 if missing_on is not None else 512
    for r in ranks:
        assert r["cold"] == one["cold"] and r["written"] == 2
        assert r["warm"] == (one["cold"][0], want)  # the same answer from the rows restored
        assert r["tier"]["hits"] == 1 and r["tier"]["hit_tokens"] == want
