"""Session-wide test settings: servers a test starts keep their KV disk tier under a temp dir."""

from __future__ import annotations

import os
import tempfile


def pytest_configure(config) -> None:
    # the disk tier's default directory is $XDG_CACHE_HOME/turnkv/kv: never the user's real cache
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="turnkv-test-cache-")
