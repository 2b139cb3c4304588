"""The packed weights of a GGUF load, kept on disk so a later start skips the packing.

``pack_gguf`` turns a GGUF's matrices into ``QuantWeight`` buffers; that takes seconds on a
small CPU, every start. This module stores those buffers (safetensors) under
``cache_root()/packed`` (``$TURNKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/turnkv``, beside the C
kernels) and hands them back to a later load whose *facts* are the same: the file's identity
(resolved path, size, mtime_ns, sampled content fingerprint), ``PACK_VERSION`` and a digest of
the packer's sources, the matmul kernel (the C build's name and ``ARITHMETIC``, or torch's
version and CPU capability), ``--weights``, dtype and device, and the tensor table.

A file's metadata holds those facts, what the loader needs to rebuild the weights, and a sha256
over both and every tensor's name, dtype, shape and bytes. A load maps the file (copy-on-write:
its pages are shared with the page cache and other processes) and checks that sum over the
mapped bytes before anything is used, so a truncated or altered file is removed with one warning
and the load packs again. Files are written under a temporary name, fsynced and renamed, never
rewritten in place: a crash leaves no file or a whole one, and two processes starting at once
each write a whole file (the last rename wins). Writing the file for new facts removes the files
of older facts for the same GGUF and settings. ``TURNKV_PACK_CACHE=off`` turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from turnkv import cbuild
from turnkv.models import cpu_int4, quant

log = logging.getLogger(__name__)

FORMAT = "turnkv-packed"
# Bump whenever what a cached file means changes (the packed layout, what is stored, what the
# loader rebuilds from it). The packer's sources are hashed into the key as well (as cbuild does
# for the C kernels), so an edit there never serves weights packed by older code.
PACK_VERSION = 1
_SOURCES = ("quant.py", "cpu_int4.py", "quant_check.py", "gguf.py", "gguf_pack.py", "pack_cache.py")
SETTING = "TURNKV_PACK_CACHE"
_ON, _OFF = ("", "auto", "on", "1"), ("off", "0")
_STALE_TMP_S = 24 * 3600  # temporary files older than this are left by a crashed writer


class PackCacheError(ValueError):
    """A cached file that must not be used; the message says why."""


def enabled() -> bool:
    """Whether the cache is on (``TURNKV_PACK_CACHE``: ``auto``/``on`` or ``off``). ValueError for
    another value, so a typo does not silently mean either."""
    value = os.environ.get(SETTING, "auto").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{SETTING}={value!r} is not one of auto, on, off")


def cache_dir() -> Path:
    from turnkv.models.gguf import cache_root

    return cache_root() / "packed"


@functools.cache
def _sources_digest() -> str:
    folder = Path(__file__).parent
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((folder / name).read_bytes())
    return h.hexdigest()[:16]


def kernel_identity() -> str:
    """What the packed bytes and the self-check's verdict depend on besides the file."""
    if quant.packed_kernel() == "c":
        return f"c:{cpu_int4.ARITHMETIC}:{cbuild.build(cpu_int4.SOURCE).name}"
    return f"torch-int4:{torch.__version__}:{torch.backends.cpu.get_cpu_capability()}:{quant.int4_layout()}"


def facts(path: Path, fingerprint: str, mode: str, dtype: torch.dtype, device: torch.device, table) -> dict:
    """The facts a cached pack must match (``table``: the loader's ``(hf_name, entry, heads)``)."""
    st = path.stat()
    rows = [(n, e.type_name, list(e.shape), e.offset, h) for n, e, h in table]
    return {
        "format": FORMAT,
        "version": str(PACK_VERSION),
        "sources": _sources_digest(),
        "file": str(path.resolve()),
        "size": str(st.st_size),
        "mtime_ns": str(st.st_mtime_ns),
        "content": fingerprint,
        "kernel": kernel_identity(),
        "weights": mode,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device.type,
        "table": hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16],
    }


def _digest(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def entry_path(f: dict) -> Path:
    """``<stem>-<slot>-<key>.safetensors``: the slot names the GGUF and settings, the key all facts."""
    slot = _digest(json.dumps([f["file"], f["weights"], f["dtype"], f["device"], f["kernel"]]), 12)
    key = _digest(json.dumps(f, sort_keys=True), 16)
    return cache_dir() / f"{Path(f['file']).stem}-{slot}-{key}.safetensors"


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def checksum(header: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of the metadata fields and, in name order, every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(_bytes(t))
    return "sha256:" + h.hexdigest()


def read(f: dict) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """``(meta, tensors)`` stored for facts ``f``, or None: no file, or one that failed its checks
    (then removed, with a warning). The tensors map the file, the bytes the checksum read."""
    path = entry_path(f)
    try:
        ino = path.stat().st_ino
    except OSError:
        return None
    try:
        return _decode(path, f)
    except (PackCacheError, SafetensorError, OSError, ValueError, KeyError, RuntimeError) as exc:
        log.warning("packed-weights cache %s is unusable (%s): removed, packing again", path.name, exc)
    try:
        if path.stat().st_ino == ino:  # not a whole file another process renamed in meanwhile
            path.unlink()
    except OSError:
        pass
    return None


def _decode(path: Path, f: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as st:
        md = dict(st.metadata() or {})
        # views of the file's private (copy-on-write) map: pages shared with other processes and
        # the page cache; the files are never rewritten in place, so the bytes verified stay
        # the bytes used (the C kernel's loads need no alignment: measured no slower at 8 bytes)
        tensors = {n: st.get_tensor(n) for n in st.keys()}
    want = md.pop("checksum", None)
    if want != checksum(md, tensors):
        raise PackCacheError("checksum mismatch")
    if md.get("facts") != json.dumps(f, sort_keys=True):
        raise PackCacheError("written for other facts")
    return json.loads(md["meta"]), tensors


def write(f: dict, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Store ``tensors`` (contiguous CPU tensors) and ``meta`` (JSON) for facts ``f``; a cache that
    cannot be written is skipped with a warning."""
    path = entry_path(f)
    header = {"facts": json.dumps(f, sort_keys=True), "meta": json.dumps(meta)}
    header["checksum"] = checksum(header, tensors)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
        os.close(fd)
        save_file(tensors, tmp, metadata=header)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())  # durable before it has its name
        os.replace(tmp, path)
        tmp = None
    except (OSError, SafetensorError) as exc:  # a full disk, a read-only home: run without it
        log.warning("could not write the packed-weights cache under %s: %s", path.parent, exc)
        return
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    _prune(path)


def _prune(kept: Path) -> None:
    """Remove the files of older facts for the same GGUF and settings, and crashed writers' leftovers."""
    slot = kept.name.rsplit("-", 1)[0]
    now = time.time()
    for other in kept.parent.iterdir():
        try:
            if other.name.startswith(".tmp-"):
                if now - other.stat().st_mtime > _STALE_TMP_S:
                    other.unlink()
            elif other != kept and other.name.rsplit("-", 1)[0] == slot:
                other.unlink()
        except OSError:
            pass  # another process removed it first
