"""The disk tier's unit: a block of 256 tokens' K and V rows of every layer, its key and its file.

A block's key is a chained hash, ``H(parent key, context, namespace, the block's token ids)``,
where the *context* (:func:`block_context`) covers everything else the rows depend on: the model
fingerprint (weights, KV dtype, KV geometry; ``turnkv.models.load.cache_fingerprint``), the KV
dtype and layout facts once more, the block size and the format version. So block ``i`` of a
conversation names its whole token prefix: identical prefixes in any conversation of one
namespace share blocks, and nothing of another model, dtype, geometry or namespace can match.

A block file is safetensors (no pickle): tensors ``k``, ``v`` ``[L, Hkv, 256, D]`` and ``tokens``
``[256]`` int64, and string metadata ``format``, ``version``, ``key``, ``parent``, ``context``,
``depth``, ``dtype``, ``shape`` and ``checksum``: ``sha256:`` of the other metadata fields (as
sorted JSON) and then the bytes of ``k``, ``v`` and ``tokens``, so no field can change unseen. :func:`decode_block` returns a block only when every metadata field is exactly what
the file's own content implies and the checksum matches; anything else raises :class:`BlockError`.

SHA-256 rather than a CRC: a block read back is either the exact bytes written or refused, with no
practical chance of a collision; hashing bounds a restore (docs/BENCHMARKS.md, 'Disk tier'), so
the tier hashes blocks on several threads.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from turnkv.kv.cache import KVShape

BLOCK_TOKENS = 256
FORMAT = "turnkv.kv-block"
FORMAT_VERSION = 1
ROOT_KEY = "0" * 64  # the parent of a conversation's first block


class BlockError(Exception):
    """A block that cannot be used: missing, unreadable, truncated, foreign, older or corrupt."""


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
    """The bytes of a contiguous CPU tensor, as a buffer ``hashlib`` reads without a copy."""
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


def payload_checksum(facts: dict[str, str], k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor) -> str:
    h = hashlib.sha256(json.dumps(facts, sort_keys=True).encode())
    for t in (k, v, tokens):
        _feed(h, t)
    return "sha256:" + h.hexdigest()


def metadata(block: Block, tokens: torch.Tensor) -> dict[str, str]:
    """The metadata a file holding ``block`` (whose ids are ``tokens``) must carry, exactly."""
    facts = {
        "format": FORMAT,
        "version": str(FORMAT_VERSION),
        "key": block.key,
        "parent": block.parent,
        "context": block.context,
        "depth": str(block.depth),
        "dtype": dtype_name(block.k.dtype),
        "shape": ",".join(str(s) for s in block.k.shape),
    }
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


def decode_block(
    path: str, key: str, pin: bool = False, into: tuple[torch.Tensor, torch.Tensor] | None = None
) -> Block:
    """Read and verify the block file ``path`` that should hold ``key``; raise :class:`BlockError`.

    ``k`` and ``v`` are copied out of the file's mapping into ``into`` (CPU views ``[L, Hkv, 256,
    D]``, e.g. this block's rows of a segment being assembled) or else into private memory (pinned
    with ``pin``), and the checksum is taken over that copy: the bytes verified are the bytes used.
    After a ``BlockError`` the contents of ``into`` are undefined.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            md = f.metadata() or {}
            _check_format(md, set(f.keys()))
            tokens = _private(f.get_tensor("tokens"), False)
            k, v = _rows(f.get_tensor("k"), f.get_tensor("v"), pin, into)
    except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
        raise BlockError(f"unreadable: {type(exc).__name__}: {exc}") from exc
    return _verified(key, md, tokens, k, v)


def decode_bytes(
    data: bytes, key: str, pin: bool = False, into: tuple[torch.Tensor, torch.Tensor] | None = None
) -> Block:
    """:func:`decode_block` of a block's bytes held in memory (a store that is not a file system)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        if len(data) < 8:
            raise ValueError(f"{len(data)} bytes is no safetensors header")
        n = int.from_bytes(data[:8], "little")
        md = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
        tensors = load(data)
        _check_format(md, set(tensors))
        k, v = _rows(tensors["k"], tensors["v"], pin, into)
        tokens = tensors["tokens"]
    except (SafetensorError, ValueError, RuntimeError, AttributeError) as exc:
        raise BlockError(f"unreadable: {type(exc).__name__}: {exc}") from exc
    return _verified(key, md, tokens, k, v)


def _check_format(md: dict, names: set[str]) -> None:
    if md.get("format") != FORMAT or md.get("version") != str(FORMAT_VERSION):
        raise BlockError(
            f"not a {FORMAT} v{FORMAT_VERSION} file (format {md.get('format')!r}, version {md.get('version')!r})"
        )
    if names != {"k", "v", "tokens"}:
        raise BlockError(f"tensors {sorted(names)}, expected k, v, tokens")


def _rows(k: torch.Tensor, v: torch.Tensor, pin: bool, into) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``, ``v`` copied into ``into`` when it fits, else into private memory (pinned with ``pin``)."""
    if into is not None and k.shape == into[0].shape and v.shape == into[1].shape:
        if k.dtype != into[0].dtype or v.dtype != into[1].dtype:
            raise BlockError(f"block holds {k.dtype}, expected {into[0].dtype}")
        host_copy(into[0], k)
        host_copy(into[1], v)
        return into
    return _private(k, pin), _private(v, pin)


def _verified(key: str, md: dict, tokens: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Block:
    """The block, once every metadata field is what its content implies and the checksum matches."""
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype or k.shape[2] != BLOCK_TOKENS:
        raise BlockError(f"k/v of {list(k.shape)}/{list(v.shape)} is not a block")
    if tokens.dtype != torch.int64 or tuple(tokens.shape) != (BLOCK_TOKENS,):
        raise BlockError(f"token ids of {tokens.dtype} {list(tokens.shape)}")
    try:
        depth = int(md.get("depth", ""))
    except ValueError as exc:
        raise BlockError(f"depth {md.get('depth')!r} is not a number") from exc
    block = Block(key, md.get("parent", ""), md.get("context", ""), depth, tuple(tokens.tolist()), k, v)
    want = metadata(block, tokens)
    if md != want:
        bad = sorted(n for n in set(md) | set(want) if md.get(n) != want.get(n))
        raise BlockError(f"metadata does not match the content ({', '.join(bad)})")
    return block


def _private(t: torch.Tensor, pin: bool) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    host_copy(out, t)
    return out
