"""The load-time support verdict for the fused route, and the ``turnkv selfcheck`` probe.

``decide`` answers once per model load whether multi-segment attention may use the fused Triton
kernel: never on an unsupported shape or device, and only after the kernel ran at the model's own
head_dim, GQA group and dtype, in steps laid out and launched as serving's (``STEP_PROBES``,
``run_step_probe``: so the variants it compiles are serving's own), and matched the fp32
reference (``reference.py``) within ``tolerance``. Any failure keeps the ``lse`` route and
says why in the ``Verdict``. Triton is imported lazily, so this module imports on any machine.

Tolerance (per element): ``|out - ref| <= u * (|ref| + A) + 2**-16 * A``, where ``u`` is the unit
roundoff of the dtype (2**-8 for bf16, 2**-11 for fp16) and ``A`` is the same attention over
``|v|``. The ``u * |ref|`` term is the one final rounding; ``u * A`` bounds rounding the
probabilities to the input dtype before P·V (``|sum_j (p^_j - p_j) v_j| <= u * sum_j p_j |v_j|``);
the last term leaves room for fp32 summation order. An exact fp32 result rounded once is inside it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from turnkv.attention import cpu_native
from turnkv.attention.backend import AttentionBackend
from turnkv.attention.portable import PortableBackend
from turnkv.attention.reference import reference_attention
from turnkv.attention.verdict import Verdict
from turnkv.kv.cache import KVWindow, Views
from turnkv.limits import MAX_GQA, SUPPORTED_DTYPE_NAMES, SUPPORTED_HEAD_DIMS

log = logging.getLogger(__name__)

SUPPORTED_DTYPES = tuple(getattr(torch, n) for n in SUPPORTED_DTYPE_NAMES)
FusedFn = Callable[..., torch.Tensor]  # triton_segments.fused_attention: (q, views, scale) -> out


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: the kernel runs on the CPU through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def tolerance(
    q: torch.Tensor, views: Views, scale: float, ref: torch.Tensor, window_start=None
) -> torch.Tensor:
    """Per-element error allowed for a fused result against the fp32 ``ref`` (see module doc)."""
    a = reference_attention(q, [(k, v.abs()) for k, v in views], scale, window_start)
    return unit_roundoff(q.dtype) * (ref.abs() + a) + 2.0**-16 * a


def error_ratio(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> float:
    """max |out - ref| / tol over all elements; 0/0 (a row that sees no key, exactly zero) counts 0."""
    err = (out.float() - ref).abs()
    ratio = torch.where(err == 0, torch.zeros_like(err), err / tol)
    return ratio.max().item() if ratio.numel() else 0.0


@dataclass(frozen=True)
class ProbeShape:
    """One probe case: head counts, head_dim, window rows and the view lengths (the last holds the window)."""

    head_dim: int
    num_heads: int
    num_kv_heads: int
    rows: int
    lengths: tuple[int, ...]


@dataclass
class ProbeResult:
    head_dim: int
    num_heads: int
    num_kv_heads: int
    rows: int
    segments: int
    keys: int
    max_err: float
    tol_ratio: float  # max over elements of |err| / tolerance; <= 1 passes
    ok: bool
    error: str | None = None
    name: str = ""  # a step probe's (``STEP_PROBES``); "" for a single-sequence probe


def probe_views(shape: ProbeShape, dtype: torch.dtype, device: torch.device, seed: int) -> tuple:
    """Random q and views for ``shape``: strided slices of a [layers, Hkv, capacity, D] buffer, like the
    KV layouts hand out (head and row strides differ between views)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    views = []
    for i, n in enumerate(shape.lengths):
        cap = n + 8 * (i % 3 + 1)  # spare capacity, as a tail buffer has
        k = torch.randn(2, shape.num_kv_heads, cap, shape.head_dim, generator=g)
        v = torch.randn(2, shape.num_kv_heads, cap, shape.head_dim, generator=g)
        k, v = k.to(device, dtype), v.to(device, dtype)
        views.append((k[1, :, :n], v[1, :, :n]))
    q = torch.randn(shape.num_heads, shape.rows, shape.head_dim, generator=g).to(device, dtype)
    return q, views


def run_probe(fused: FusedFn, shape: ProbeShape, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Runs ``fused`` at ``shape`` against the fp32 reference; never raises (errors become ``ok=False``)."""
    keys = sum(shape.lengths)
    res = ProbeResult(shape.head_dim, shape.num_heads, shape.num_kv_heads, shape.rows, len(shape.lengths), keys,
                      float("nan"), float("nan"), False)  # fmt: skip
    try:
        q, views = probe_views(shape, dtype, device, seed)
        scale = shape.head_dim**-0.5
        out = fused(q, views, scale)
        ref = reference_attention(q, views, scale)
        res.max_err = (out.float() - ref).abs().max().item()
        res.tol_ratio = error_ratio(out, ref, tolerance(q, views, scale, ref))
        res.ok = (
            out.dtype == dtype
            and out.shape == q.shape
            and bool(torch.isfinite(out).all())
            and res.tol_ratio <= 1
        )
    except Exception as exc:  # a compile or launch failure is a failed check, not a crash at load
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    return res


# The load-time probes: steps laid out as the engine lays them out and launched as a serving step
# launches them (``STEP_PROBES``), so the kernel variants they compile are the ones serving
# replays, and the warm-up that follows finds them compiled instead of paying for a second set.
# Each window is ``(view lengths of its history, rows)``: its window rows end the last view.
WindowLayout = tuple[tuple[int, ...], int]
_MANY = (129,) * 12 + (700,)  # thirteen views: two groups of MAX_SEGMENTS (an eager step)
STEP_PROBES: dict[str, tuple[str, list[WindowLayout]]] = {
    # a graphed mixed step: a decode row and a verify-sized window (the narrow table, 32-row
    # grid) beside a prefill chunk over a history (the wide table, its row bucket)
    "mixed": ("mixed", [((4099,), 1), ((0, 1, 3001, 517), 4), ((129,) * 8 + (700,), 300)]),
    # a graphed decode step: one-row windows, the split count of their key bucket
    "decode": ("decode", [((4099,), 1), ((0, 1, 3001), 1), ((129,) * 11 + (700,), 1)]),
    # an eager step of a conversation past MAX_SEGMENTS views (two groups per sequence)
    "groups": ("eager", [(_MANY, 1), (_MANY, 40)]),
}
_SMALL = {  # the CPU interpreter's (TRITON_INTERPRET=1): the same structure, few keys
    "mixed": [((37,), 1), ((0, 1, 45), 4), ((3,) * 5 + (21,), 40)],
    "decode": [((37,), 1), ((0, 1, 45), 1), ((3,) * 11 + (21,), 1)],
    "groups": [((3,) * 12 + (21,), 1), ((3,) * 12 + (21,), 40)],
}


def run_step_probe(
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 99,
    name: str = "mixed",
) -> ProbeResult:
    """The fused backend as the engine runs it: one plan for a ragged step (``STEP_PROBES[name]``)
    over all-layer views, launched as serving launches it (``mixed_launch``/``decode_launch``, as a
    CUDA graph of the step bakes in, or eagerly), then ``rope_store`` (at cos 1, sin 0: k and v
    stored as given) and ``attend`` at layer 1 with q in the engine's ``[N, Hq, D]`` layout
    (a slice of one qkv buffer), against the fp32 reference per window. Never raises (errors
    become ``ok=False``)."""
    from turnkv.attention.fused import FusedBackend

    mode, layouts = STEP_PROBES[name]
    layouts = _SMALL[name] if device.type == "cpu" else layouts
    keys = sum(sum(lengths) + m for lengths, m in layouts)
    rows = sum(m for _, m in layouts)
    views_n = max(len(lengths) for lengths, _ in layouts)
    res = ProbeResult(head_dim, num_heads, num_kv_heads, rows, views_n, keys, float("nan"), float("nan"), False,
                      name=name)  # fmt: skip
    try:
        g = torch.Generator(device="cpu").manual_seed(seed)
        windows = []
        for lengths, m in layouts:
            views = []
            for i, n in enumerate((*lengths[:-1], lengths[-1] + m)):
                kv = torch.randn(2, 2, num_kv_heads, n + 8 * (i % 3 + 1), head_dim, generator=g)
                kv = kv.to(device, dtype)
                views.append((kv[0, :, :, :n], kv[1, :, :, :n]))  # [L=2, Hkv, n, D] strided views
            windows.append(KVWindow(tuple(views), sum(lengths), m))
        backend = FusedBackend(Verdict(), num_heads, num_kv_heads, head_dim, device)
        launch = None
        if mode == "mixed":
            launch = backend.mixed_launch(windows)
        elif mode == "decode":
            launch = backend.decode_launch(windows)
        if mode != "eager" and launch is None:
            raise AssertionError(f"the {name} probe's step has no {mode} launch (a graph would not take it)")
        step = backend.plan(windows, launch)
        heads = num_heads + 2 * num_kv_heads
        qkv = torch.randn(rows, heads, head_dim, generator=g).to(device, dtype)  # the qkv matmul's output
        qk, v = qkv.split_with_sizes((num_heads + num_kv_heads, num_kv_heads), 1)
        cos = torch.ones(rows, head_dim, device=device, dtype=dtype)
        sin = torch.zeros(rows, head_dim, device=device, dtype=dtype)
        q = step.rope_store(1, qk, v, cos, sin)  # [N, Hq, D]: q as given (cos 1, sin 0)
        k = qk[:, num_heads:]
        out = step.attend(1, q, head_dim**-0.5)
        if not torch.equal(q, qk[:, :num_heads]):
            raise AssertionError("rope_store at cos 1, sin 0 changed q")
        errs, ratios, start = [], [], 0
        for w in windows:
            qs = q[start : start + w.rows].transpose(0, 1)
            views = w.layer_views(1)
            for got_kv, want in ((views[-1][0], k), (views[-1][1], v)):
                if not torch.equal(got_kv[:, -w.rows :], want[start : start + w.rows].transpose(0, 1)):
                    raise AssertionError("rope_store wrote the wrong k/v rows")
            ref = reference_attention(qs, views, head_dim**-0.5)
            got = out[start : start + w.rows].transpose(0, 1)
            errs.append((got.float() - ref).abs().max().item())
            ratios.append(error_ratio(got, ref, tolerance(qs, views, head_dim**-0.5, ref)))
            start += w.rows
        res.max_err, res.tol_ratio = max(errs), max(ratios)
        res.ok = bool(torch.isfinite(out).all()) and res.tol_ratio <= 1
    except Exception as exc:  # a compile or launch failure is a failed check, not a crash at load
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    return res


def _unsupported(
    head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> tuple[str, str] | None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim_{head_dim}_unsupported", f"the kernel takes head_dim {SUPPORTED_HEAD_DIMS}"
    if num_kv_heads <= 0 or num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GQA:
        return f"gqa_{num_heads}_{num_kv_heads}_unsupported", f"the kernel takes GQA groups of 1-{MAX_GQA}"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype_{str(dtype).removeprefix('torch.')}_unsupported", "the kernel takes bf16 and fp16"
    return None


def _load_kernel() -> tuple[FusedFn | None, str | None]:
    try:
        from turnkv.attention.triton_segments import fused_attention
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return fused_attention, None


def decide(
    mode: str, device: torch.device, head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> tuple[Verdict, FusedFn | None]:
    """The route for multi-segment attention at load: ``(Verdict, checked kernel or None)``.

    ``mode``: ``auto`` | ``fused`` | ``lse`` (``--attention``). The fused callable is returned only
    with ``verdict == "ok"``; ``fused`` mode with any failing verdict serves lse and says so.
    """
    if mode not in ("auto", "fused", "lse"):
        raise ValueError(f"--attention must be auto, fused or lse, not {mode!r}")
    device = torch.device(device)
    if mode == "lse":
        return Verdict("lse", "forced_lse", "--attention lse"), None
    verdict, fused = _check(mode, device, head_dim, num_heads, num_kv_heads, dtype)
    if verdict.verdict != "ok" and mode == "fused":
        verdict.reason = f"--attention fused was asked, but {verdict.reason}; serving the lse route"
        log.warning("%s", verdict.reason)
    return verdict, fused


def _check(mode, device, head_dim, num_heads, num_kv_heads, dtype) -> tuple[Verdict, FusedFn | None]:
    cpu_check = device.type == "cpu" and interpreting() and mode == "fused"
    if device.type != "cuda" and not cpu_check:
        return Verdict("lse", "no_cuda", f"the fused kernel needs a CUDA device (got {device.type})"), None
    bad = _unsupported(head_dim, num_heads, num_kv_heads, dtype)
    if bad:
        return Verdict("lse", bad[0], bad[1]), None
    fused, why = _load_kernel()
    if fused is None:
        return Verdict("lse", "triton_missing", f"triton does not import ({why})"), None
    t0 = time.perf_counter()
    # only steps as serving launches them: each kernel variant compiled here is one the warm-up
    # and serving reuse (a single-sequence probe compiles its own: 23 s of a cold start on the H200)
    # first the kernel's entry point on one sequence (a one-row window over ~8K keys: the
    # variant a batch-1 decode step takes), then the steps, once it passed
    lengths = (0, 1, 45) if device.type == "cpu" else (0, 1, 3001, 5001)
    results = [run_probe(fused, ProbeShape(head_dim, num_heads, num_kv_heads, 1, lengths), dtype, device)]
    if results[0].ok:
        results += [
            run_step_probe(head_dim, num_heads, num_kv_heads, dtype, device, seed=99 + i, name=name)
            for i, name in enumerate(STEP_PROBES)
        ]
    report = _report(results, dtype, time.perf_counter() - t0)
    if not report["passed"]:
        worst = next(r for r in results if not r.ok)
        why = worst.error or f"error {worst.max_err:.3g} is {worst.tol_ratio:.2f}x the tolerance"
        reason = f"self-check failed at {_label(worst)}: {why}"
        return Verdict("lse", "selfcheck_failed", reason, report), None
    reason = (
        f"self-check passed: one sequence and {len(STEP_PROBES)} steps ({', '.join(STEP_PROBES)}) at head_dim {head_dim}, "
        f"{num_heads}/{num_kv_heads} heads"
    )
    return Verdict("fused", "ok", reason, report), fused


def make_backend(
    mode: str,
    device: torch.device,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    deterministic: bool = False,
) -> AttentionBackend:
    """The engine's attention backend: the verdict is decided once; ``fused`` only when it is ``ok``.
    ``deterministic`` (``--deterministic on``): the fused launches take fixed tiles and fixed key
    pieces (``triton_segments.fixed_config``), so a row's bits depend on its own keys only."""
    verdict, fused = decide(mode, device, head_dim, num_heads, num_kv_heads, dtype)
    if fused is None:
        if device.type == "cpu":
            # build or load the CPU decode kernel at load, not inside the first decode step: the
            # thread governor times that step, and a 2-thread probe that paid for it lost
            cpu_native.library()
        return PortableBackend(verdict, dtype)
    from turnkv.attention.fused import FusedBackend

    return FusedBackend(verdict, num_heads, num_kv_heads, head_dim, device, deterministic)


def _label(r: ProbeResult) -> str:
    if r.name:
        return (
            f"the {r.name} step (head_dim {r.head_dim}, {r.num_heads}/{r.num_kv_heads} heads, {r.rows} rows)"
        )
    return f"head_dim {r.head_dim}, {r.num_heads}/{r.num_kv_heads} heads, {r.rows} rows, {r.segments} views"


def _report(results: list[ProbeResult], dtype: torch.dtype, seconds: float) -> dict:
    return {
        "passed": all(r.ok for r in results),
        "dtype": str(dtype).removeprefix("torch."),
        "tolerance": "|out-ref| <= u*(|ref|+A) + 2^-16*A; u = unit roundoff, A = attention over |v|",
        "worst_tol_ratio": max((r.tol_ratio for r in results), default=0.0),
        "seconds": round(seconds, 3),
        "shapes": [asdict(r) for r in results],
    }


def cli_shapes(small: bool) -> list[ProbeShape]:
    """Representative shapes for ``turnkv selfcheck``: head_dim 64/128/256 x GQA 1/4/8 x rows 1/4/32."""
    heads = [(2, 2), (8, 2), (8, 1)] if small else [(8, 8), (32, 8), (32, 4)]
    lengths = (0, 5, 1, 30) if small else (2047, 0, 1, 8190, 333)
    out = []
    for d in SUPPORTED_HEAD_DIMS:
        for hq, hkv in heads:
            for rows in (1, 4, 32):
                out.append(ProbeShape(d, hq, hkv, rows, (*lengths[:-1], lengths[-1] + rows)))
    return out


def cli_main(device: str, as_json: bool) -> int:
    """``turnkv selfcheck [--device D] [--json]``: probe, print verdict and per-shape error. Exit code
    0 when the kernel passed or, on a CPU, when it is not available there (``no_cuda``: the answer a
    CPU is expected to give); 1 when it failed, does not import, or a CUDA device asked for is
    missing."""
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    dtype = torch.bfloat16
    results: list[ProbeResult] = []
    verdict = Verdict()
    cuda = dev.type == "cuda" and torch.cuda.is_available()
    if not cuda and not (dev.type == "cpu" and interpreting()):
        verdict = Verdict(
            "lse", "no_cuda", f"no CUDA device ({dev}); set TRITON_INTERPRET=1 to check on the CPU"
        )
    else:
        fused, why = _load_kernel()
        if fused is None:
            verdict = Verdict("lse", "triton_missing", f"triton does not import ({why})")
        else:
            t0 = time.perf_counter()
            results = [
                run_probe(fused, s, dtype, dev, seed=i) for i, s in enumerate(cli_shapes(dev.type == "cpu"))
            ]
            report = _report(results, dtype, time.perf_counter() - t0)
            ok = report["passed"]
            verdict = Verdict(
                "fused" if ok else "lse",
                "ok" if ok else "selfcheck_failed",
                f"{sum(r.ok for r in results)}/{len(results)} shapes within tolerance",
                report,
            )
    if as_json:
        print(json.dumps({"device": str(dev), **asdict(verdict)}))
    else:
        _print_table(dev, verdict, results)
    return 0 if verdict.verdict == "ok" or (verdict.verdict == "no_cuda" and dev.type == "cpu") else 1


def _print_table(dev: torch.device, verdict: Verdict, results: list[ProbeResult]) -> None:
    out = sys.stdout
    if results:
        out.write(
            f"{'head_dim':>8} {'heads':>6} {'rows':>4} {'views':>5} {'keys':>6} {'max_err':>9} {'tol_ratio':>9}  ok\n"
        )
        for r in results:
            line = f"{r.head_dim:>8} {r.num_heads:>3}/{r.num_kv_heads:<2} {r.rows:>4} {r.segments:>5} {r.keys:>6} "
            line += f"{r.max_err:>9.2e} {r.tol_ratio:>9.3f}  {'yes' if r.ok else 'NO'}"
            out.write(line + (f"  {r.error}" if r.error else "") + "\n")
    out.write(f"device {dev}: verdict {verdict.verdict} (route {verdict.route}): {verdict.reason}\n")
