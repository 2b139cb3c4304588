"""The disk tier's unit: a block of 256 tokens' K and V rows of every layer, its key and its file.

A block's key is a chained hash, ``H(parent key, context, namespace, the block's token ids)``,
where the *context* (:func:`block_context`) covers everything else the rows depend on: the model
fingerprint (weights, KV dtype, KV geometry; ``turnkv.models.load.cache_fingerprint``), the KV
dtype and layout facts once more, the block size and the format version. So block ``i`` of a
conversation names its whole token prefix: identical prefixes in any conversation of one
namespace share blocks, and nothing of another model, dtype, geometry or namespace can match.

A block file is safetensors (no pickle): tensors ``k``, ``v`` ``[L, Hkv, 256, D]`` and ``tokens``
``[256]`` int64, and string metadata ``format``, ``version``, ``key``, ``parent``, ``context``,
``depth``, ``dtype``, ``shape`` and ``checksum``: ``xxh3-128:`` of the other metadata fields (as
sorted JSON) and then the bytes of ``k``, ``v`` and ``tokens``, so no field can change unseen.
:func:`decode_block` returns a block only when every metadata field is exactly what the file's
own content implies and the checksum matches; anything else raises :class:`BlockError`.

Files are written by the safetensors library and read here: the header parsed (its tensors must
tile the data exactly, as the library demands), ``k`` and ``v`` read with ``os.preadv`` straight
into the memory that will hold them (a segment's rows, a pinned staging slot) a chunk at a time,
each chunk hashed while still in the cache. A restore is bound by that read and the hash, not
by copies (docs/BENCHMARKS.md, "Restore stages").

XXH3-128 (the ``xxhash`` library) as the checksum, not SHA-256: it guards against corruption
(bit flips, a torn or truncated write, a file of another block or model), which it misses with a
chance of 2^-128, not against an adversary: the checksum is not keyed, so whoever can write the
store can write a valid block whatever the hash. SHA-256 bounded a restore from a warm page
cache; XXH3-128 is many times faster (docs/BENCHMARKS.md, "Block checksums: XXH3-128"); the
block *keys*, which name content across replicas, stay chained SHA-256. Format version 2; the
keys cover the version, so a version-1 file is never found by a lookup: the LRU evicts it, and a
rebuild removes it and counts it apart from the files that fail verification (:class:`OtherVersion`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from turnkv.kv.cache import KVShape

BLOCK_TOKENS = 256
FORMAT = "turnkv.kv-block"
FORMAT_VERSION = 2  # 1: SHA-256 checksums
CHECKSUM = "xxh3-128"
ROOT_KEY = "0" * 64  # the parent of a conversation's first block


class BlockError(Exception):
    """A block that cannot be used: missing, unreadable, truncated, foreign, older or corrupt."""


class OtherVersion(BlockError):
    """A block file of another format version (an older or newer turnkv's). Its key's context
    covers that version, so no lookup of this version names it: a scan of the directory finds it
    (a rebuild), never a read of a key, and it is no sign of damage."""


@dataclass(frozen=True)
class Block:
    """One block: ``k``, ``v`` ``[L, Hkv, BLOCK_TOKENS, D]`` (CPU, contiguous) and its token ids."""

    key: str
    parent: str
    context: str
    depth: int  # the block's place in its chain: rows [depth * 256, (depth + 1) * 256)
    tokens: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def block_context(fingerprint: str, shape: KVShape) -> str:
    """The hex digest of what a block's rows depend on besides its tokens and namespace."""
    facts = (
        f"{FORMAT}/{FORMAT_VERSION}|model={fingerprint}|dtype={dtype_name(shape.dtype)}"
        f"|layers={shape.num_layers}|kv_heads={shape.num_kv_heads}|head_dim={shape.head_dim}"
        f"|block={BLOCK_TOKENS}"
    )
    return hashlib.sha256(facts.encode()).hexdigest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


def block_keys(context: str, namespace: str, tokens: Sequence[int], count: int | None = None) -> list[str]:
    """Keys of the first ``count`` whole blocks of ``tokens`` (default: every whole block)."""
    whole = len(tokens) // BLOCK_TOKENS
    count = whole if count is None else min(count, whole)
    ctx = bytes.fromhex(context)
    ns = hashlib.sha256(namespace.encode()).digest()
    keys: list[str] = []
    parent = ROOT_KEY
    for i in range(count):
        h = hashlib.sha256(bytes.fromhex(parent))
        h.update(ctx)
        h.update(ns)
        h.update(token_bytes(tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]))
        parent = h.hexdigest()
        keys.append(parent)
    return keys


def _raw(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, as a buffer the checksum reads without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy()


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for CPU tensors of one shape and dtype, by numpy: one thread, no GIL.

    Disk threads copy many blocks at once; torch's copy would start its OpenMP pool from each of
    them, which is many times slower (docs/BENCHMARKS.md)."""
    np.copyto(_bytes(dst), _bytes(src))


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy() if t.dim() else t.reshape(1).view(torch.uint8).numpy()


def _feed(h, t: torch.Tensor) -> None:
    """Feed ``t``'s bytes in C order. ``t`` may be a slice of a longer segment along the row axis
    (``[L, Hkv, rows, D]`` with every ``[rows, D]`` plane contiguous): the planes go one by one,
    which is the same byte stream as the contiguous tensor."""
    if t.is_contiguous():
        h.update(_raw(t))
        return
    for plane in t.flatten(0, -3):  # [L * Hkv, rows, D], a view
        h.update(_raw(plane))


def _checksum_of(facts: dict[str, str]):
    """The checksum's hash, fed with ``facts`` (sorted JSON); the payload's bytes follow."""
    return xxhash.xxh3_128(json.dumps(facts, sort_keys=True).encode())


def payload_checksum(facts: dict[str, str], k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor) -> str:
    h = _checksum_of(facts)
    for t in (k, v, tokens):
        _feed(h, t)
    return f"{CHECKSUM}:{h.hexdigest()}"


def _facts(key: str, parent: str, context: str, depth: int, dtype: torch.dtype, shape) -> dict[str, str]:
    """Every metadata field of a block file but its checksum, as its content implies them."""
    return {
        "format": FORMAT,
        "version": str(FORMAT_VERSION),
        "key": key,
        "parent": parent,
        "context": context,
        "depth": str(depth),
        "dtype": dtype_name(dtype),
        "shape": ",".join(str(s) for s in shape),
    }


def metadata(block: Block, tokens: torch.Tensor) -> dict[str, str]:
    """The metadata a file holding ``block`` (whose ids are ``tokens``) must carry, exactly."""
    facts = _facts(block.key, block.parent, block.context, block.depth, block.k.dtype, block.k.shape)
    return facts | {"checksum": payload_checksum(facts, block.k, block.v, tokens)}


def _tensors(block: Block) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if len(block.tokens) != BLOCK_TOKENS or block.k.shape[2] != BLOCK_TOKENS:
        raise ValueError(
            f"a block holds {BLOCK_TOKENS} rows; got {block.k.shape[2]} for {len(block.tokens)} ids"
        )
    tokens = torch.tensor(block.tokens, dtype=torch.int64)
    return {"k": block.k, "v": block.v, "tokens": tokens}, metadata(block, tokens)


def write_block(block: Block, path: str | os.PathLike) -> None:
    """Write ``block`` (contiguous CPU tensors) as the safetensors file ``path``.

    ``save_file`` serializes without the GIL; ``save`` (bytes) holds it for the whole copy (tens
    of ms for an 8B block), which stalled the engine thread behind the disk writers."""
    from safetensors.torch import save_file

    tensors, md = _tensors(block)
    save_file(tensors, path, metadata=md)


def encode_block(block: Block) -> bytes:
    """The safetensors bytes of ``block``, for stores that keep bytes (Redis); holds the GIL."""
    from safetensors.torch import save

    tensors, md = _tensors(block)
    return save(tensors, metadata=md)


def decode_block(path: str, key: str, into: tuple[torch.Tensor, torch.Tensor] | None = None) -> Block:
    """Read and verify the block file ``path`` that should hold ``key``; raise :class:`BlockError`.

    ``k`` and ``v`` are read straight from the file (``os.preadv``, no mapping, no staging copy)
    into ``into`` (CPU views ``[L, Hkv, 256, D]`` whose ``[256, D]`` planes are contiguous: this
    block's rows of a segment being assembled, or a pinned staging slot) or else into private
    memory, a chunk at a time, each chunk hashed while it is still in the cache: the bytes
    verified are the bytes used. After a ``BlockError`` the contents of ``into`` are undefined.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise BlockError(f"unreadable: {type(exc).__name__}: {exc}") from exc
    try:
        return _decode(_File(fd), key, into)
    finally:
        os.close(fd)


def decode_bytes(data: bytes, key: str, into: tuple[torch.Tensor, torch.Tensor] | None = None) -> Block:
    """:func:`decode_block` of a block's bytes held in memory (a store that is not a file system)."""
    return _decode(_Bytes(data), key, into)


class _File:
    """A block file read at offsets (``preadv`` releases the GIL: readers run in parallel)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.size = fd, os.fstat(fd).st_size

    def read(self, offset: int, bufs: list[np.ndarray]) -> None:
        """Fill ``bufs`` (uint8, C-contiguous) with the bytes from ``offset`` on, exactly."""
        while bufs:
            try:
                got = os.preadv(self.fd, bufs, offset)
            except OSError as exc:
                raise BlockError(f"unreadable: {type(exc).__name__}: {exc}") from exc
            if got == 0:
                raise BlockError(f"truncated: {self.size} bytes, the read at {offset} found none")
            offset += got
            while bufs and got >= bufs[0].nbytes:  # a short read (rare): go on where it stopped
                got -= bufs.pop(0).nbytes
            if bufs and got:
                bufs[0] = bufs[0][got:]


class _Bytes:
    """A block's bytes in memory, read like a file (``np.copyto`` releases the GIL)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.size = memoryview(data).cast("B"), len(data)

    def read(self, offset: int, bufs: list[np.ndarray]) -> None:
        for buf in bufs:
            if offset + buf.nbytes > self.size:
                raise BlockError(f"truncated: {self.size} bytes, {buf.nbytes} wanted at {offset}")
            np.copyto(buf, np.frombuffer(self.data, np.uint8, buf.nbytes, offset).reshape(buf.shape))
            offset += buf.nbytes


HEADER_MAX = 1 << 20  # a block's safetensors header is ~1 KiB; more is not a block
# bytes read, then hashed while still in the core's L2 (2 MiB here): a block read and verified in
# chunks of 256 KiB took 0.78 CPU s/GB, of 1 MiB 0.86, whole 16 MiB tensors 1.09 (one thread, SHA-256;
# docs/BENCHMARKS.md, "Restore stages"); each chunk is two calls that release and retake the GIL,
# so not smaller. xxhash 4.x releases the GIL only for an update of more than 64 KiB: a contiguous
# chunk does; the planes of a strided one (rows of a longer segment, a CPU restore) are hashed one
# by one under the GIL (docs/BENCHMARKS.md, "Block checksums: XXH3-128")
CHUNK = 512 << 10
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64}
NAMES = ("k", "v", "tokens")


def _decode(src: _File | _Bytes, key: str, into: tuple[torch.Tensor, torch.Tensor] | None) -> Block:
    """The block in ``src`` (safetensors bytes) once its metadata is what its content implies and
    the checksum over what was read matches; else :class:`BlockError`."""
    md, tensors, base = _header(src)
    _check_format(md, set(tensors))
    (kd, ks, ko), (vd, vs, vo), (td, ts, to) = (tensors[n] for n in NAMES)
    if len(ks) != 4 or ks != vs or kd != vd or ks[2] != BLOCK_TOKENS or min(ks) < 1:
        raise BlockError(f"k/v of {ks}/{vs} is not a block")
    if td != torch.int64 or ts != [BLOCK_TOKENS]:
        raise BlockError(f"token ids of {td} {ts}")
    try:
        depth = int(md.get("depth", ""))
    except ValueError as exc:
        raise BlockError(f"depth {md.get('depth')!r} is not a number") from exc
    facts = _facts(key, md.get("parent", ""), md.get("context", ""), depth, kd, ks)
    k, v = _destination(ks, kd, into)
    h = _checksum_of(facts)  # payload_checksum's stream, fed as the chunks are read
    for t, at in ((k, ko), (v, vo)):
        for bufs in _chunks(t):
            src.read(base + at, list(bufs))
            for b in bufs:
                h.update(b)
                at += b.nbytes
    ids = np.empty(BLOCK_TOKENS, "<i8")
    src.read(base + to, [ids.view(np.uint8)])
    h.update(ids)
    want = facts | {"checksum": f"{CHECKSUM}:{h.hexdigest()}"}
    if md != want:
        bad = sorted(n for n in set(md) | set(want) if md.get(n) != want.get(n))
        raise BlockError(f"metadata does not match the content ({', '.join(bad)})")
    return Block(key, facts["parent"], facts["context"], depth, tuple(ids.tolist()), k, v)


def _check_format(md: dict, names: set[str]) -> None:
    version = md.get("version")
    if md.get("format") == FORMAT and version != str(FORMAT_VERSION) and str(version).isdecimal():
        raise OtherVersion(f"a {FORMAT} file of format version {version}, not {FORMAT_VERSION}")
    if md.get("format") != FORMAT or version != str(FORMAT_VERSION):
        raise BlockError(
            f"not a {FORMAT} v{FORMAT_VERSION} file (format {md.get('format')!r}, version {md.get('version')!r})"
        )
    if names != set(NAMES):
        raise BlockError(f"tensors {sorted(names)}, expected k, v, tokens")


def _header(src: _File | _Bytes) -> tuple[dict, dict[str, tuple[torch.dtype, list[int], int]], int]:
    """(metadata, name -> (dtype, shape, data offset), where the data starts) of a safetensors
    file, whose tensors must tile its data exactly (as the safetensors library demands)."""
    if src.size < 8:
        raise BlockError(f"unreadable: {src.size} bytes is no safetensors header")
    head = np.empty(min(src.size, 4096), np.uint8)
    src.read(0, [head])
    n = int.from_bytes(head[:8].tobytes(), "little")
    if n > HEADER_MAX or 8 + n > src.size:
        raise BlockError(f"unreadable: a header of {n} bytes in a file of {src.size}")
    raw = head[8 : 8 + n].tobytes()
    if len(raw) < n:
        rest = np.empty(n - len(raw), np.uint8)
        src.read(8 + len(raw), [rest])
        raw += rest.tobytes()
    try:
        header = json.loads(raw)
        md = header.pop("__metadata__", None) or {}
        if not isinstance(md, dict) or not all(isinstance(x, str) for kv in md.items() for x in kv):
            raise TypeError("the metadata is not a map of strings")  # what safetensors writes
        tensors, spans = {}, []
        for name, info in header.items():
            dtype, shape, (lo, hi) = info["dtype"], info["shape"], info["data_offsets"]
            if not all(type(x) is int and x >= 0 for x in (*shape, lo, hi)):
                raise ValueError(f"tensor {name!r}: shape {shape}, offsets {lo}, {hi}")
            size = DTYPES[dtype].itemsize if dtype in DTYPES else 0
            if size == 0 or hi - lo != size * math.prod(shape):
                raise ValueError(f"tensor {name!r} of {dtype} {shape} spans bytes {lo}..{hi}")
            tensors[name] = (DTYPES[dtype], shape, lo)
            spans.append((lo, hi))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise BlockError(f"unreadable: {type(exc).__name__}: {exc}") from exc
    end = 0
    for lo, hi in sorted(spans):
        if lo != end:
            raise BlockError(f"unreadable: the tensors do not tile the data (a gap or overlap at {lo})")
        end = hi
    if 8 + n + end != src.size:
        raise BlockError(f"unreadable: {src.size} bytes, the header describes {8 + n + end}")
    return md, tensors, 8 + n


def _destination(shape: list[int], dtype: torch.dtype, into) -> tuple[torch.Tensor, torch.Tensor]:
    """``into`` when it has the block's shape, else private memory."""
    if into is not None and list(into[0].shape) == shape and list(into[1].shape) == shape:
        if into[0].dtype != dtype or into[1].dtype != dtype:
            raise BlockError(f"block holds {dtype}, expected {into[0].dtype}")
        return into
    return torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)


def _chunks(t: torch.Tensor):
    """``t``'s bytes in C order as lists of uint8 arrays of about ``CHUNK`` bytes each. ``t`` is
    ``[L, Hkv, 256, D]`` with every ``[256, D]`` plane contiguous (maybe a row slice of a longer
    segment): a list is one contiguous run, or the planes of a strided one."""
    planes = t.view(t.shape[0] * t.shape[1], -1).view(torch.uint8).numpy()  # [L * Hkv, 256 * D * size]
    step = max(1, CHUNK // planes.shape[1])
    for lo in range(0, planes.shape[0], step):
        part = planes[lo : lo + step]
        yield [part.reshape(-1)] if part.flags.c_contiguous else list(part)
