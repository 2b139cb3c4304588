"""Summarize a step timeline (``TURNKV_STEP_TRACE=FILE turnkv serve ...``, turnkv/engine/step_trace.py):
where a served pass's wall time went, on the device and on the engine thread.

    TURNKV_STEP_TRACE=/tmp/steps.jsonl python bench/serve_load.py ... --variants 1024
    python bench/step_trace.py /tmp/steps.jsonl

Takes the pipeline with the most steps (the served one; the warm-up's pipelines are apart) and
prints per kind of step (with prompt rows: ``mixed``; ``decode``) the count, the device ms of a
step, and the engine thread's ms per step in its phases: ``launch`` (stage and enqueue),
``wait`` (for the step's tokens), ``advance`` (the turns take their tokens), ``other`` (from
the previous step's tokens taken to this launch: admission, gathering windows). The device's
idle time is the sum of the gaps between one step's end and the next one's start.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def summarize(recs: list[dict]) -> dict:
    recs = sorted(recs, key=lambda r: r["launch"])
    wall = recs[-1]["done"] - recs[0]["launch"]
    out: dict = {"steps": len(recs), "wall_s": round(wall, 3)}
    dev = [r["device_ms"] for r in recs if "device_ms" in r]
    idle = [r["idle_ms"] for r in recs if "idle_ms" in r]
    out["device_busy_s"] = round(sum(dev) / 1e3, 3)
    out["device_idle_s"] = round(sum(idle) / 1e3, 3)
    out["idle_ms_p50_p90_p99"] = [round(pct(idle, q), 3) for q in (0.5, 0.9, 0.99)]
    prev_done = None
    kinds: dict[str, dict[str, list[float]]] = {}
    for r in recs:
        kind = "mixed" if r["prompt_rows"] else "decode"
        k = kinds.setdefault(kind, {p: [] for p in ("device", "launch", "wait", "advance", "other", "rows")})
        k["launch"].append((r["launched"] - r["launch"]) * 1e3)
        k["wait"].append((r["synced"] - r["sync"]) * 1e3)
        k["advance"].append((r["done"] - r["synced"]) * 1e3)
        k["rows"].append(r["rows"])
        if "device_ms" in r:
            k["device"].append(r["device_ms"])
        if prev_done is not None:
            k["other"].append(max(0.0, (r["launch"] - prev_done) * 1e3))
        prev_done = r["done"]
    out["graph_steps"] = dict(Counter("graph" if r["graph"] else "eager" for r in recs))
    out["kinds"] = {
        kind: {"count": len(v["rows"])}
        | {f"{p}_ms_mean": round(statistics.fmean(xs), 3) for p, xs in v.items() if xs and p != "rows"}
        | {
            "device_ms_p50": round(pct(v["device"], 0.5), 3),
            "rows_mean": round(statistics.fmean(v["rows"]), 1),
        }
        for kind, v in kinds.items()
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="the TURNKV_STEP_TRACE file")
    ap.add_argument("--json", help="write the summary here too")
    args = ap.parse_args()
    recs = [json.loads(line) for line in open(args.trace) if line.strip()]
    groups = Counter((r["pid"], r["trace"]) for r in recs)
    served = groups.most_common(1)[0][0]
    s = summarize([r for r in recs if (r["pid"], r["trace"]) == served])
    print(f"steps {s['steps']}  wall {s['wall_s']} s  device busy {s['device_busy_s']} s  "
          f"idle {s['device_idle_s']} s (gaps p50/p90/p99 {s['idle_ms_p50_p90_p99']} ms)  {s['graph_steps']}")  # fmt: skip
    cols = ("count", "rows_mean", "device_ms_mean", "device_ms_p50", "launch_ms_mean", "wait_ms_mean",
            "advance_ms_mean", "other_ms_mean")  # fmt: skip
    print("| kind | " + " | ".join(cols) + " |")
    print("| --- |" + " ---: |" * len(cols))
    for kind, v in s["kinds"].items():
        print(f"| {kind} | " + " | ".join(str(v.get(c, "-")) for c in cols) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
