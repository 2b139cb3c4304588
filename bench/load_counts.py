"""Many concurrent multi-turn conversations through a real ``turnkv serve`` on a small bank: how
many turns were answered, refused (and with which status), and whether any answer was a 5xx.

Each of ``--clients`` threads holds one conversation of ``--turns`` turns (its own system prompt,
then short user messages) and resends its whole history every turn, as a chat client does. The
bank is set small (``--bank-bytes``) so conversations evict each other. Prints one table and
writes JSON under ``bench/out/``. The counts go into docs/RELIABILITY.md ("Load").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def conversation(base: str, i: int, turns: int, max_tokens: int, counts: collections.Counter, lock) -> None:
    messages = [{"role": "system", "content": f"You are assistant number {i}. Answer in one short sentence."}]
    with httpx.Client(base_url=base, timeout=600) as http:
        for t in range(turns):
            messages.append({"role": "user", "content": f"Turn {t}: name a colour and a number."})
            r = http.post(
                "/v1/chat/completions",
                json={"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0},
            )
            with lock:
                counts[r.status_code] += 1
                if r.status_code == 200:
                    counts["cached_tokens"] += (
                        r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                    )
            if r.status_code != 200:
                return
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})


def cpu_name() -> str:
    """The CPU's model name and whether it has AVX-512 (benchmarks name the CPU they ran on)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    return f"{name or platform.machine()} ({'AVX-512' if 'avx512f' in info else 'no AVX-512'})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--bank-bytes", default="16M")
    ap.add_argument("--port", type=int, default=8391)
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "turnkv", "serve", "--port", str(args.port), "--bank-bytes", args.bank_bytes]
    server = subprocess.Popen([*cmd, "--no-disk"], stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        counts: collections.Counter = collections.Counter()
        lock = threading.Lock()
        t0 = time.monotonic()
        threads = [
            threading.Thread(target=conversation, args=(base, i, args.turns, args.max_tokens, counts, lock))
            for i in range(args.clients)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        seconds = time.monotonic() - t0
        health = httpx.get(base + "/health").json()
        alive = server.poll() is None
    finally:
        server.terminate()
        server.wait(timeout=60)
    statuses = {str(k): v for k, v in counts.items() if isinstance(k, int)}
    out = {
        "clients": args.clients,
        "turns": args.turns,
        "bank_bytes": args.bank_bytes,
        "asked": args.clients * args.turns,
        "statuses": statuses,
        "server_errors": sum(v for k, v in counts.items() if isinstance(k, int) and k >= 500 and k != 507),
        "cached_tokens": counts["cached_tokens"],
        "evictions": health["bank"].get("evictions"),
        "seconds": round(seconds, 1),
        "server_alive": alive,
        "cpu": cpu_name(),
    }
    print("| clients x turns | bank | statuses | 5xx | cached tokens | evictions | s | alive |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    print(
        f"| {args.clients} x {args.turns} | {args.bank_bytes} | {statuses} | {out['server_errors']} | "
        f"{out['cached_tokens']} | {out['evictions']} | {out['seconds']} | {alive} |"
    )
    where = Path("bench/out")
    where.mkdir(parents=True, exist_ok=True)
    (where / "load_counts.json").write_text(json.dumps(out, indent=1))
    os._exit(0 if alive and out["server_errors"] == 0 else 1)


if __name__ == "__main__":
    main()
