"""``--bank-bytes auto``: the session bank's budget from the memory the device has free."""

from __future__ import annotations

import os

import torch

AUTO_SHARE_CUDA = 0.80  # of the device memory free after the weights are loaded
AUTO_SHARE_CPU = 0.50  # of the RAM the OS reports available at start


def auto_budget_bytes(device: torch.device | str) -> int:
    """``--bank-bytes auto``: 80 % of the CUDA memory free now (call it after loading the weights),
    or 50 % of the RAM the OS reports available on any other device."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * AUTO_SHARE_CUDA)
    return int(_available_ram() * AUTO_SHARE_CPU)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
