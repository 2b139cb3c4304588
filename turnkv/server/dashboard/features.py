"""What each on/off field of ``/health`` means on this server, in plain words and one of four tones.

This is the one place where the dashboard decides how a status looks (the page only maps a tone
to a colour):

- ``ok``: on and working (green);
- ``off``: off, and that is the expected state here -- by the device (no GPU on a CPU server) or by
  a flag the operator gave (grey, with the reason in words);
- ``warn``: a real degradation: something this server could use is not working (amber);
- ``bad``: a fault (red).

``features(doc)`` reads a ``/health`` document only, so the same figures give the same colours
wherever they are shown. A field this module does not know shows its raw value in a neutral tone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Tone = Literal["ok", "off", "warn", "bad"]
NO_GPU = "off — no GPU"
MATMUL = {"c": "C", "torch-int4": "torch int4"}  # /health.weights.matmul in words


@dataclass(frozen=True)
class Feature:
    key: str  # stable name, e.g. "attention", "graphs" (what the page looks up)
    label: str  # what the page calls it
    tone: Tone
    text: str  # short: "on", "off — no GPU", ...
    why: str  # one plain sentence for the tooltip

    def doc(self) -> dict:
        return asdict(self)


def _on_gpu(doc: dict) -> bool:
    return str(doc.get("device", "")).startswith("cuda")


def _server(doc: dict) -> Feature:
    if doc.get("status") == "ok":
        return Feature("server", "server", "ok", "serving", "the server takes new turns")
    return Feature(
        "server",
        "server",
        "bad",
        "unavailable",
        "new turns are refused (503): a tensor-parallel rank is down",
    )


def _attention(doc: dict) -> Feature:
    a = doc.get("attention") or {}
    verdict, reason = str(a.get("verdict", "")), str(a.get("reason") or "")
    label = "fused attention"
    if not verdict:
        return Feature("attention", label, "off", "—", "not reported")
    if verdict == "ok":
        return Feature(
            "attention",
            label,
            "ok",
            "on",
            "one GPU kernel reads every segment of a conversation (self-checked)",
        )
    portable = "attention runs on the portable route (lse), which computes the same attention within rounding"
    if verdict == "no_cuda" and not _on_gpu(doc):
        return Feature("attention", label, "off", NO_GPU, f"the fused kernel is for CUDA GPUs; {portable}")
    if verdict == "forced_lse":
        return Feature("attention", label, "off", "off — --attention lse", f"chosen at start-up; {portable}")
    if verdict == "selfcheck_failed":
        return Feature("attention", label, "bad", "off — self-check failed", f"{reason}; {portable}")
    # triton_missing, a model shape the kernel does not take, ...: a GPU that runs the slower route
    return Feature("attention", label, "warn", "off — " + verdict.replace("_", " "), f"{reason}; {portable}")


def _selfcheck(doc: dict) -> Feature:
    sc = (doc.get("attention") or {}).get("selfcheck")
    label = "kernel self-check"
    if not isinstance(sc, dict):
        return Feature(
            "selfcheck",
            label,
            "off",
            "not run",
            "it checks the fused GPU kernel at load; that kernel is not used here",
        )
    if sc.get("passed"):
        return Feature(
            "selfcheck", label, "ok", "passed", "the fused kernel matched the fp32 reference at load"
        )
    return Feature("selfcheck", label, "bad", "failed", "the fused kernel did not match the fp32 reference")


def _cpu_kernel(doc: dict) -> Feature:
    status = (doc.get("attention") or {}).get("cpu_kernel")
    label = "C attention kernel"
    if status is None:
        return Feature(
            "cpu_kernel", label, "off", "not used — GPU", "decode attention in C is for CPU servers"
        )
    if status == "ok":
        return Feature("cpu_kernel", label, "ok", "on", "decode attention on this CPU runs in compiled C")
    if str(status).startswith("off"):  # "off (TURNKV_CPU_KERNEL)": switched off on purpose
        how = str(status).removeprefix("off").strip(" ()")
        return Feature(
            "cpu_kernel", label, "off", f"off — {how}" if how else "off", "decode attention runs as torch ops"
        )
    return Feature(
        "cpu_kernel", label, "warn", "off — not built", f"decode attention runs as slower torch ops: {status}"
    )


def _graphs(doc: dict, attention: Feature) -> Feature:
    status = str(((doc.get("scheduler") or {}).get("graphs") or {}).get("status", ""))
    label = "CUDA graphs"
    if status == "on":
        return Feature("graphs", label, "ok", "on", "every step replays captured GPU launches")
    if status.startswith("off: no CUDA"):
        return Feature("graphs", label, "off", NO_GPU, "captured steps need a CUDA GPU")
    if status.startswith("off: the attention route is not fused"):
        tone: Tone = "off" if attention.tone in ("ok", "off") else "warn"  # follows attention's cause
        return Feature(
            "graphs", label, tone, "off — attention not fused", "captured steps need fused attention"
        )
    if not status:
        return Feature("graphs", label, "off", "—", "not reported")
    return Feature("graphs", label, "off", status.replace("off: ", "off — "), "chosen at start-up")


def _run_ahead(doc: dict) -> Feature:
    sched = doc.get("scheduler") or {}
    ra = sched.get("run_ahead") or {}
    label = "run-ahead"
    why = "the next step is launched before this step's tokens are read back"
    if ra.get("enabled"):
        return Feature("run_ahead", label, "ok", "on", why)
    graphs_on = (sched.get("graphs") or {}).get("status") == "on"
    if graphs_on:
        return Feature("run_ahead", label, "off", "off — --run-ahead off", f"chosen at start-up ({why})")
    return Feature(
        "run_ahead", label, "off", "off — needs CUDA graphs", f"by default it runs with CUDA graphs ({why})"
    )


def _speculation(doc: dict) -> Feature:
    status = str((doc.get("speculation") or {}).get("status", ""))
    label = "speculative decoding"
    why = "drafts copied from the conversation, verified exactly: the same text, sooner"
    if status == "on":
        return Feature("speculation", label, "ok", "on", why)
    if not status:
        return Feature("speculation", label, "off", "—", "not reported")
    # off by --speculate off, or by the setup (tensor parallelism): a choice, not a fault
    cause = status.removeprefix("off: ")
    text = "off — --speculate off" if cause == "--speculate off" else "off"
    return Feature("speculation", label, "off", text, f"{cause} ({why})")


def _weights(doc: dict) -> Feature:
    w = doc.get("weights") or {}
    held, note, matmul = w.get("held"), str(w.get("note") or ""), w.get("matmul")
    label = "packed weights"
    if held == "packed":
        return Feature(
            "weights",
            label,
            "ok",
            "on",
            f"4/8-bit GGUF matrices stay packed ({MATMUL.get(matmul, matmul)} matmul): {note}",
        )
    failed = "failed" in note
    if held == "mixed":
        tone: Tone = "warn" if failed else "off"
        return Feature(
            "weights", label, tone, "partly", f"some matrices are expanded to full precision: {note}"
        )
    if note.startswith("torch ") or failed:  # a CPU that could pack but has no kernel, or a failed check
        return Feature(
            "weights", label, "warn", "off — see why", f"matrices expanded to full precision: {note}"
        )
    if note.startswith("packed weights run on CPU"):
        return Feature("weights", label, "off", "not used — GPU", "packed matrices are for CPU servers")
    if note == "--weights dequant":
        return Feature("weights", label, "off", "off — --weights dequant", "chosen at start-up")
    return Feature(
        "weights", label, "off", "off", note or "the model is not a quantized GGUF file: nothing to pack"
    )


def _ram(doc: dict) -> Feature:
    """The host-RAM tier, beside the disk tier: between the GPU bank and the disk."""
    r = doc.get("ram") or {}
    label = "RAM tier"
    if not r.get("enabled"):
        return Feature("ram", label, "off", "off", str(r.get("reason") or "--no-ram"))
    used = f"{r.get('blocks', 0)} of {r.get('capacity_blocks', 0)} blocks, {r.get('hits', 0)} restores"
    if r.get("dropped", 0):
        return Feature("ram", label, "warn", "on — full", f"{used}; {r['dropped']} blocks found no free slot")
    return Feature("ram", label, "ok", "on", f"sealed turns are mirrored to host memory; {used}")


def _disk(doc: dict) -> Feature:
    d = doc.get("disk") or {}
    label = "disk tier"
    if not d.get("enabled"):
        return Feature(
            "disk", label, "off", "off", "finished turns are kept in memory only (--no-disk or no disk dir)"
        )
    if d.get("degraded"):  # its store raises: every lookup is a miss (recomputed)
        return Feature("disk", label, "warn", "degraded — recomputing", str(d["degraded"]))
    troubles = {
        k: d.get(k, 0) for k in ("write_failures", "dropped_writes", "corrupt", "faults") if d.get(k, 0)
    }
    if troubles:
        detail = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in troubles.items())
        return Feature("disk", label, "warn", "on — with errors", f"finished turns go to disk; {detail}")
    return Feature(
        "disk", label, "ok", "on", "finished and evicted turns are kept on disk and survive restarts"
    )


def _tensor_parallel(doc: dict) -> Feature:
    tp = doc.get("tensor_parallel") or {}
    size, label = int(tp.get("size", 1) or 1), "tensor parallel"
    if tp.get("status", "ok") != "ok":
        dead = ", ".join(map(str, tp.get("dead_ranks") or [])) or "?"
        return Feature("tensor_parallel", label, "bad", "down", f"rank(s) {dead} stopped: {tp.get('error')}")
    if size <= 1:
        return Feature("tensor_parallel", label, "off", "off — one device", "the model runs on one device")
    return Feature(
        "tensor_parallel", label, "ok", f"on — {size} GPUs", f"each layer is split over {size} GPUs"
    )


def features(doc: dict) -> list[Feature]:
    """Every on/off field of the ``/health`` document ``doc``, classified."""
    attention = _attention(doc)
    return [
        _server(doc),
        attention,
        _selfcheck(doc),
        _cpu_kernel(doc),
        _graphs(doc, attention),
        _run_ahead(doc),
        _speculation(doc),
        _weights(doc),
        _ram(doc),
        _disk(doc),
        _tensor_parallel(doc),
    ]
