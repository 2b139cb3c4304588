"""How the CPU matmuls of one decode step scale from 1 row to 8: what batch-8 decode can gain.

For every weight matrix of the default model's step (each layer's q|k|v, o, gate|up and down, and
the LM head), in one process: turnkv's C kernel (``c``: what ``--weights packed`` runs where a C
compiler is found; the Q8_0 head in its int8 form), torch's int4 kernel on the same planes (``int4``:
the fallback; a Q8_0 matrix is two planes, two calls), dense bf16 and dense fp32 ``F.linear``, at
``M`` = 1 and 8 rows, on 1 and 2 threads. Per step: the layers' sum times the layer count, plus the head. Also
measured: the dense bf16 GEMM rate and the copy rate of this machine, the floor of 8 rows: the
step's FLOPs over that rate, or its weight bytes over the copy rate, whichever is larger.

    python bench/cpu_matmul.py

Prints a table, writes ``bench/out/<tag>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from report import save

from turnkv.models import cpu_int4
from turnkv.models.quant import GROUP, _int4_mm

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536, 30 layers, vocabulary 49152
LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)
LAYERS = 30
HEAD_PLANES = 2  # the default GGUF's token_embd (the tied LM head) is Q8_0: two int4 planes
FORMS = ("c", "int4", "bf16", "fp32")


def timed(f, repeat: int) -> float:
    for _ in range(5):
        f()
    t = time.perf_counter()
    for _ in range(repeat):
        f()
    return (time.perf_counter() - t) / repeat


def matrix(n: int, k: int, rows: int, repeat: int, q8: bool = False) -> dict[str, float]:
    """ms of one ``[rows, k] x [k, n]`` product in each form (``q8``: the C kernel's int8 form)."""
    u = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 2)
    scale = torch.rand(n, k // GROUP).half().float()
    sz = torch.stack([scale, torch.zeros(n, k // GROUP)], -1)
    sz = sz.transpose(0, 1).contiguous().to(torch.bfloat16)
    if q8:
        c_packed = cpu_int4.pack_q8((u * 16 - 128).to(torch.int8), scale, n, k)
    else:
        c_packed = cpu_int4.pack([(u.to(torch.uint8), scale, -8 * scale)], n, k)
    w = torch.randn(n, k)
    wb = w.to(torch.bfloat16)
    x = torch.randn(rows, k)
    xb = x.to(torch.bfloat16)
    mm = _int4_mm()
    return {
        "c": 1e3 * timed(lambda: cpu_int4.mm(xb, c_packed, n), repeat),
        "int4": 1e3 * timed(lambda: mm(xb, packed, GROUP, sz), repeat),
        "bf16": 1e3 * timed(lambda: F.linear(xb, wb), repeat),
        "fp32": 1e3 * timed(lambda: F.linear(x, w), repeat),
    }


def step(rows: int, repeat: int) -> dict[str, float]:
    """ms of one decode step's matmuls in each form (int4: the head's two planes)."""
    per = {name: matrix(n, k, rows, repeat) for name, (n, k) in LAYER.items()}
    head = matrix(*HEAD, rows, max(repeat // 10, 5), q8=True)
    out = {}
    for form in FORMS:
        planes = HEAD_PLANES if form == "int4" else 1
        out[form] = LAYERS * sum(p[form] for p in per.values()) + planes * head[form]
    return out


def copy_rate() -> float:
    """Bytes/s of a 64 MiB host copy (read + written) on the threads set now."""
    x = torch.empty(64 * 2**20, dtype=torch.uint8)
    y = torch.empty_like(x)
    return 2 * x.numel() / timed(lambda: y.copy_(x), 10)


def rates() -> dict[str, float]:
    a = torch.randn(512, 576, dtype=torch.bfloat16)
    b = torch.randn(576, 3072, dtype=torch.bfloat16)
    gemm = 2 * 512 * 576 * 3072 / timed(lambda: a @ b, 20)
    return {"bf16_gemm_flop_s": gemm, "copy_bytes_s": copy_rate()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--tag", default="cpu_matmul")
    args = ap.parse_args()
    if cpu_int4.library() is None or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise SystemExit(f"needs the C kernel ({cpu_int4.status()}) and torch's int4 op (torch>=2.6)")
    params = LAYERS * sum(n * k for n, k in LAYER.values()) + HEAD[0] * HEAD[1]
    # a plane: 4 bits a value and a bf16 scale and zero per 32 values (5 bits a value)
    packed_bytes = (params + (HEAD_PLANES - 1) * HEAD[0] * HEAD[1]) * 5 / 8
    results: dict = {"params": params, "packed_bytes": packed_bytes, "runs": []}
    print(
        f"{'threads':>7} | {'form':>5} | {'1 row ms':>8} | {'8 rows ms':>9} | {'8/1':>5} | {'floor of 8 rows ms':>18}"
    )
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        r = rates()
        floor8 = 1e3 * max(2 * 8 * params / r["bf16_gemm_flop_s"], packed_bytes / r["copy_bytes_s"])
        one, eight = step(1, args.repeat), step(8, args.repeat)
        for form in FORMS:
            run = {"threads": threads, "form": form, "rows1_ms": one[form], "rows8_ms": eight[form],
                   "ratio": eight[form] / one[form], "floor8_ms": floor8, **r}  # fmt: skip
            results["runs"].append(run)
            print(
                f"{threads:>7} | {form:>5} | {one[form]:>8.2f} | {eight[form]:>9.2f} | "
                f"{run['ratio']:>5.2f} | {floor8:>18.2f}"
            )
        print(
            f"        bf16 GEMM {r['bf16_gemm_flop_s'] / 1e9:.0f} GFLOP/s, copy {r['copy_bytes_s'] / 1e9:.1f} GB/s"
        )
    save(results, args.tag, _plot)


def _plot(results: dict, plt, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels, ones, eights = [], [], []
    for r in results["runs"]:
        labels.append(f"{r['form']}\n{r['threads']} thr")
        ones.append(r["rows1_ms"])
        eights.append(r["rows8_ms"])
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], ones, 0.4, label="1 row")
    ax.bar([x + 0.2 for x in xs], eights, 0.4, label="8 rows")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("ms of matmuls per decode step")
    ax.set_title("default model's decode matmuls on this CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
