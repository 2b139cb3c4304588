"""``--ram-bytes``: the host-RAM tier's budget, and opening the tier (``bank.ram``) for a server.

The memory the process may use is the smaller of what the OS reports available (``MemAvailable``)
and what its cgroup still allows (``memory.max - memory.current``, v2; or v1's limit - usage).
``auto`` takes ``AUTO_SHARE`` of it on CUDA and is off on a CPU device (the bank is already in host
memory there). An explicit budget may be at most that memory less room for the OS (``os_room``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from turnkv.bank.budget import _available_ram
from turnkv.config import EngineConfig, parse_size

log = logging.getLogger(__name__)

AUTO_SHARE = 0.4  # of the memory the process may use, for --ram-bytes auto on CUDA
OS_ROOM_MIN = 2 << 30  # left to the OS and the process's own memory, at least ...
OS_ROOM_SHARE = 0.10  # ... or this share of it
GIB = 1 << 30
_CGROUP = Path("/sys/fs/cgroup")


def process_room() -> int:
    """Bytes of host memory this process may still take: MemAvailable, capped by its cgroup."""
    room = _available_ram()
    for limit, usage in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            cap = (_CGROUP / limit).read_text().strip()
            used = int((_CGROUP / usage).read_text().strip())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 1 << 60:  # "max" or v1's huge number: no limit
            room = min(room, max(int(cap) - used, 0))
        break
    return room


def max_ram_bytes(room: int | None = None) -> int:
    """The largest ``--ram-bytes`` this machine allows: the process's room less the OS's."""
    room = process_room() if room is None else room
    return max(room - max(OS_ROOM_MIN, int(room * OS_ROOM_SHARE)), 0)


def ram_budget(cfg: EngineConfig, device: torch.device | str | None = None) -> tuple[int, str | None]:
    """``(bytes, None)``, or ``(0, why the tier is off)``; ValueError for a budget the machine
    cannot hold (one line naming the flag and the maximum). ``device`` None: not known yet."""
    if cfg.no_ram:
        return 0, "--no-ram"
    if cfg.tensor_parallel > 1:
        return 0, "tensor parallelism (every rank's bank must decide alike; not supported yet)"
    if cfg.ram_bytes == "auto":
        if device is None:
            return 0, None
        if torch.device(device).type != "cuda":
            return 0, "auto on a CPU device (the bank is already in host memory; --ram-bytes N turns it on)"
        return int(process_room() * AUTO_SHARE), None
    n = parse_size(cfg.ram_bytes)
    if n == 0:
        return 0, "--ram-bytes 0"
    most = max_ram_bytes()
    if n > most:
        raise ValueError(
            f"--ram-bytes (TURNKV_RAM_BYTES) {cfg.ram_bytes} is more than this machine allows: at most "
            f"{most / GIB:.1f} GiB ({most} bytes: the memory this process may use less "
            f"{max(OS_ROOM_MIN, int(process_room() * OS_ROOM_SHARE)) / GIB:.1f} GiB for the OS)"
        )
    return n, None


def open_ram(engine, below=None, reserve=None):
    """``(RamTier or None, why it is off)`` for ``engine``'s KV rows, feeding ``below`` (a DiskTier);
    ``reserve``: the pool's pinned memory, taken before the load (``start_reserve``: its size is
    the budget). A pinned allocation that fails leaves the tier off with the reason (serving goes on)."""
    from turnkv.bank.disk_blocks import BLOCK_TOKENS
    from turnkv.bank.ram import RamTier

    size, off = (reserve.total, None) if reserve is not None else ram_budget(engine.cfg, engine.shape.device)
    if size == 0:
        return None, off or "off"
    block = BLOCK_TOKENS * engine.shape.bytes_per_row  # k and v of 256 rows
    capacity = size // block
    off = f"--ram-bytes {size} is smaller than one block ({block} bytes)"
    if capacity > 0:
        try:
            return RamTier(engine.info.fingerprint, engine.shape, capacity, below, reserve), None
        except (RuntimeError, MemoryError) as exc:  # pinning failed: serve without the tier
            off = f"allocating pinned host memory for the RAM tier failed: {exc}".splitlines()[0]
            log.warning("KV RAM tier off: %s; serving goes on", off)
    if reserve is not None:
        reserve.close()  # no tier takes its chunks
    return None, off


def start_reserve(cfg: EngineConfig):
    """The RAM tier's pool, taken on threads of its own before the model loads
    (``host_memory.HostReserve``: pinning beside the load and the self-check costs nothing;
    pinned on CUDA, plain pages on a CPU device), or None where there is no tier."""
    from turnkv.bank.host_memory import HostReserve
    from turnkv.bank.ram_pool import CHUNK_BYTES
    from turnkv.models.load import resolve_device

    device = resolve_device(cfg.device)
    size, _ = ram_budget(cfg, device)
    return HostReserve(size, CHUNK_BYTES, pinned=device.type == "cuda") if size > 0 else None
