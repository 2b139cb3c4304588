"""``turnkv serve`` child processes for the benches that need several (``shared_restore``), and
the shared block store they use: a temporary directory or a ``redis-server`` of the run's own."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """``turnkv serve`` in a child process on a port of its own (the caller's caches kept, unlike
    ``startup_gpu.ServeProcess``, which isolates them on purpose)."""

    def __init__(self, name: str, model: str, device: str, store: str, extra: list[str]) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "turnkv", "serve", "--model", model, "--device", device]
        cmd += ["--port", str(self.port), "--disk-store", store, *extra]
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())

    def tail(self) -> str:
        return "\n".join(self.lines[-30:])

    def wait_ready(self, timeout: float = 600) -> float:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.t0
            if time.perf_counter() - self.t0 > timeout:
                raise RuntimeError(f"replica {self.name} not ready in {timeout} s:\n{self.tail()}")
            time.sleep(0.1)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=30).json()

    def ttft_sum(self) -> tuple[float, int]:
        """(sum, count) of the engine's TTFT histogram (``/metrics``)."""
        got = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("turnkv_time_to_first_token_seconds_sum", "turnkv_time_to_first_token_seconds_count"):
                got[name.rsplit("_", 1)[1]] = float(value)
        return got.get("sum", 0.0), int(got.get("count", 0))

    def rss(self) -> int:
        """Resident bytes of the process (pinned host memory counts)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
        return 0

    def kill(self) -> None:
        """A death (SIGKILL), not a clean stop: nothing queued gets a chance to finish."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


def stop_all(reps: list[Replica], grace: float = 10) -> None:
    """SIGTERM every live server at once, SIGKILL what is left after ``grace`` seconds (their
    last queued writes are of no use: the store goes with the run)."""
    live = [rep for rep in reps if rep.proc.poll() is None]
    for rep in live:
        rep.proc.send_signal(signal.SIGTERM)
    end = time.perf_counter() + grace
    for rep in live:
        try:
            rep.proc.wait(max(0.1, end - time.perf_counter()))
        except subprocess.TimeoutExpired:
            rep.proc.kill()
            rep.proc.wait(30)


def settle(reps: list[Replica], timeout: float = 30) -> float:
    """Wait until no server's resident memory moved by 64 MiB in a second: a server started with
    ``--warmup off`` pins its RAM pool once it serves (``RamPool.grow_behind``; with the warm-up
    the pool is whole before ready), which would share the host with a measured request of another
    process. Returns the seconds waited."""
    t0 = time.perf_counter()
    reps = [rep for rep in reps if rep.proc.poll() is None]
    last = [rep.rss() for rep in reps]
    while time.perf_counter() - t0 < timeout:
        time.sleep(1.0)
        now = [rep.rss() for rep in reps]
        if all(abs(a - b) < 64 << 20 for a, b in zip(now, last, strict=True)):
            break
        last = now
    return time.perf_counter() - t0


def drop_page_cache(root: Path) -> int:
    """Ask the kernel to drop the block files' cached pages (clean once written: the writer
    fsyncs), so that the restore reads the disk, as a replica on another host would; returns the
    files advised."""
    n = 0
    for path in root.rglob("*.safetensors"):
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


@contextlib.contextmanager
def store(kind: str) -> Iterator[str]:
    """A fresh ``--disk-store``: a temporary directory, or a ``redis-server`` without persistence."""
    with tempfile.TemporaryDirectory(prefix="turnkv-shared-") as tmp:
        if kind == "dir":
            yield f"dir:{tmp}"
            return
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("--store redis needs redis-server on PATH")
        port = free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", tmp],
            stdout=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.5)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


def gpu_name(device: str) -> str | None:
    if not device.startswith("cuda"):
        return None
    try:
        import torch

        return torch.cuda.get_device_name()
    except Exception as exc:  # torch absent or no device: say so
        return f"unknown ({type(exc).__name__})"
