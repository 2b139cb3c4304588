"""The budget probe's measurement kept across restarts (``--max-batch-tokens auto`` on CUDA).

A step's cost per row is a property of the GPU, the model's shape and the code, not of the
moment: measured once, the curve is written under the cache directory beside the compile cache
(``$XDG_CACHE_HOME/turnkv/probe/<key>.json``), and a restart on the same machine reuses it instead
of timing ~3 s of steps again, with the same ceiling (a probe re-timed at each start can land on
either side of the knee, and with it the warm-up's size). The key names everything the curve
depends on: the device, the torch and Triton versions, turnkv's sources, the model's cache fingerprint, the
prefill chunk, the probed sizes and the step's limits. Only a complete probe is kept; a file that
does not parse or names other sizes is ignored (measured again and rewritten). On a CPU the probe
is short and a step's cost moves with the machine's load, so it is measured every time. Delete the
directory (or ``turnkv cache``'s files) to measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from turnkv.cbuild import cache_home
from turnkv.engine.budget import StepCurve
from turnkv.engine.budget_probe import Probe

log = logging.getLogger(__name__)


def probe_path(engine, running: int, sizes: list[int]) -> Path | None:
    """Where ``engine``'s probe of ``sizes`` is kept, or None: not kept on this device."""
    device = engine.shape.device
    if device.type != "cuda":
        return None
    import triton

    facts = {
        "device": torch.cuda.get_device_name(device),
        "capability": list(torch.cuda.get_device_capability(device)),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "code": _code_stamp(),
        "model": engine.info.fingerprint,
        "chunk": engine.prefill_chunk,
        "running": running,
        "sizes": sizes,
        "graphs": engine.cfg.cuda_graphs,
        "deterministic": engine.cfg.deterministic,
    }
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]
    return cache_home() / "probe" / f"{key}.json"


def _code_stamp() -> str:
    """turnkv's sources as installed (names, sizes, mtimes): an edited or updated tree measures anew."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        st = f.stat()
        h.update(f"{f.relative_to(root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def load(path: Path | None, sizes: list[int]) -> Probe | None:
    """The kept probe at ``path`` when it measured ``sizes``; None otherwise."""
    if path is None:
        return None
    try:
        doc = json.loads(path.read_text())
        rows, ms = tuple(int(r) for r in doc["rows"]), tuple(float(m) for m in doc["ms"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if list(rows) != sizes or len(ms) != len(rows) or any(not m > 0 for m in ms):
        return None
    return Probe(StepCurve(rows, ms), 0.0, True, cached=True)


def save(path: Path | None, probe: Probe) -> None:
    """Keep ``probe`` at ``path`` (a complete one only); atomic: a crash leaves the old file or none."""
    if path is None or not probe.complete:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"rows": list(probe.curve.rows), "ms": list(probe.curve.ms)}))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache: measured again next time
        log.warning("budget probe: could not keep the measurement in %s: %s", path, exc)
