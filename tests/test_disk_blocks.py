"""Block keys and block files: what a key depends on, and that a file is read back exactly or refused.

Pins: keys chain over (parent, model fingerprint, KV dtype and geometry, namespace, token ids);
a round trip is bit-exact for every KV dtype; any flipped byte or truncation of a block file is
either refused (``BlockError``) or leaves exactly the block that was written (hypothesis); a
foreign safetensors file, an older format version and a file holding another key are refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from turnkv.bank import disk_blocks
from turnkv.bank.disk_blocks import (
    BLOCK_TOKENS,
    ROOT_KEY,
    Block,
    BlockError,
    block_context,
    block_keys,
    decode_block,
    encode_block,
    metadata,
)
from turnkv.kv.cache import KVShape
from turnkv.models.load import cache_fingerprint

CPU = torch.device("cpu")
SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=CPU)
TOKENS = [(i * 7) % 500 for i in range(3 * BLOCK_TOKENS + 17)]


def _block(shape: KVShape = SHAPE, seed: int = 0, depth: int = 0) -> Block:
    g = torch.Generator().manual_seed(seed)
    dims = (shape.num_layers, shape.num_kv_heads, BLOCK_TOKENS, shape.head_dim)
    k = torch.randn(dims, generator=g).to(shape.dtype)
    v = torch.randn(dims, generator=g).to(shape.dtype)
    ctx = block_context("fp", shape)
    tokens = TOKENS[depth * BLOCK_TOKENS : (depth + 1) * BLOCK_TOKENS]
    key = block_keys(ctx, "ns", TOKENS, depth + 1)[depth]
    return Block(key, ROOT_KEY, ctx, depth, tuple(tokens), k, v)


def _same(a: Block, b: Block) -> bool:
    return (
        (a.key, a.parent, a.context, a.depth, a.tokens) == (b.key, b.parent, b.context, b.depth, b.tokens)
        and a.k.dtype == b.k.dtype
        and torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8))
        and torch.equal(a.v.view(torch.uint8), b.v.view(torch.uint8))
    )


# -- keys -------------------------------------------------------------------------------------


def test_keys_chain_over_every_earlier_token():
    ctx = block_context("fp", SHAPE)
    keys = block_keys(ctx, "ns", TOKENS)
    assert len(keys) == 3 and len(set(keys)) == 3  # whole blocks only
    changed = list(TOKENS)
    changed[5] += 1  # a token of block 0 changes every later key
    assert all(a != b for a, b in zip(keys, block_keys(ctx, "ns", changed), strict=True))
    later = list(TOKENS)
    later[2 * BLOCK_TOKENS + 3] += 1  # a token of block 2 changes only block 2
    assert block_keys(ctx, "ns", later)[:2] == keys[:2] and block_keys(ctx, "ns", later)[2] != keys[2]
    assert block_keys(ctx, "ns", TOKENS[: 2 * BLOCK_TOKENS + 5]) == keys[:2]  # a prefix shares blocks


@pytest.mark.parametrize(
    "other",
    [
        {"namespace": "other"},
        {"fingerprint": "other-weights"},
        {"dtype": torch.bfloat16},
        {"dtype": torch.float16},
        {"num_layers": 3},
        {"num_kv_heads": 1},
        {"head_dim": 16},
    ],
)
def test_keys_differ_by_namespace_model_dtype_and_geometry(other):
    base = block_keys(block_context("fp", SHAPE), "ns", TOKENS)
    fields = {k: v for k, v in other.items() if k not in ("namespace", "fingerprint")}
    shape = dataclasses.replace(SHAPE, **fields)
    ctx = block_context(other.get("fingerprint", "fp"), shape)
    assert not set(base) & set(block_keys(ctx, other.get("namespace", "ns"), TOKENS))


def test_model_fingerprint_includes_kv_dtype_and_geometry():
    """One GGUF served in bf16 and in fp32 has one weights fingerprint but two cache fingerprints."""
    fp32 = cache_fingerprint("weights", SHAPE)
    assert fp32 == cache_fingerprint("weights", SHAPE)
    assert fp32 != cache_fingerprint("weights", dataclasses.replace(SHAPE, dtype=torch.bfloat16))
    assert fp32 != cache_fingerprint("weights", dataclasses.replace(SHAPE, num_kv_heads=1))
    assert fp32 != cache_fingerprint("other", SHAPE)
    bf16 = dataclasses.replace(SHAPE, dtype=torch.bfloat16)  # bf16 rows computed in fp32 or in bf16
    assert cache_fingerprint("weights", bf16, torch.float32) != cache_fingerprint(
        "weights", bf16, torch.bfloat16
    )
    assert cache_fingerprint("weights", bf16, torch.bfloat16) == cache_fingerprint("weights", bf16)


def test_model_fingerprint_includes_the_packed_kernel_and_its_arithmetic(monkeypatch):
    """Rows of packed weights differ by kernel, and by the C kernel's rounding: a disk tier
    written before its activations became int8 must not serve the new kernel."""
    from turnkv.models import cpu_int4

    c = cache_fingerprint("weights", SHAPE, matmul="c")
    assert (
        len(
            {cache_fingerprint("weights", SHAPE), c, cache_fingerprint("weights", SHAPE, matmul="torch-int4")}
        )
        == 3
    )
    monkeypatch.setattr(cpu_int4, "ARITHMETIC", "bf16-activations")
    assert cache_fingerprint("weights", SHAPE, matmul="c") != c


# -- files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    block = _block(dataclasses.replace(SHAPE, dtype=dtype))
    path = tmp_path / "b.safetensors"
    path.write_bytes(encode_block(block))
    assert _same(decode_block(str(path), block.key), block)


def test_a_file_of_another_key_is_refused(tmp_path):
    block = _block()
    path = tmp_path / "b.safetensors"
    path.write_bytes(encode_block(block))
    with pytest.raises(BlockError, match="key"):
        decode_block(str(path), "f" * 64)


def test_foreign_and_older_files_are_refused(tmp_path):
    block = _block()
    path = tmp_path / "b.safetensors"
    path.write_bytes(save({"weight": torch.zeros(4)}))  # somebody else's safetensors
    with pytest.raises(BlockError, match="format"):
        decode_block(str(path), block.key)
    tokens = torch.tensor(block.tokens)
    older = metadata(block, tokens) | {"version": "0"}
    path.write_bytes(save({"k": block.k, "v": block.v, "tokens": tokens}, metadata=older))
    with pytest.raises(BlockError, match="version"):
        decode_block(str(path), block.key)
    path.write_bytes(b"not safetensors at all")
    with pytest.raises(BlockError):
        decode_block(str(path), block.key)
    with pytest.raises(BlockError):
        decode_block(str(tmp_path / "missing.safetensors"), block.key)


def _version_1(block: Block) -> bytes:
    """``block`` as format version 1 wrote it: a SHA-256 checksum over the same stream."""
    import hashlib
    import json

    tokens = torch.tensor(block.tokens)
    md = {n: f for n, f in metadata(block, tokens).items() if n != "checksum"} | {"version": "1"}
    h = hashlib.sha256(json.dumps(md, sort_keys=True).encode())
    for t in (block.k, block.v, tokens):
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return save(
        {"k": block.k, "v": block.v, "tokens": tokens}, metadata=md | {"checksum": "sha256:" + h.hexdigest()}
    )


def test_version_1_files_are_never_looked_up_and_a_rebuild_drops_them_without_a_corrupt_count(
    tmp_path, monkeypatch
):
    # the keys cover the format version: a version-1 file of the same tokens has another key, so
    # no lookup finds it; with the index lost, the rebuild drops it as a file that does not verify
    # and the store starts (it is not a read's ``corrupt``: no read touches it)
    from turnkv.bank.disk_store import LocalDirStore

    block = _block()
    with monkeypatch.context() as m:
        m.setattr(disk_blocks, "FORMAT_VERSION", 1)
        v1_context = block_context("fp", SHAPE)
    assert v1_context != block.context
    v1_key = block_keys(v1_context, "ns", TOKENS, 1)[0]
    assert v1_key != block.key
    old = dataclasses.replace(block, key=v1_key, context=v1_context)
    path = tmp_path / "b.safetensors"
    path.write_bytes(_version_1(old))
    with pytest.raises(BlockError, match="version"):
        decode_block(str(path), v1_key)
    store = LocalDirStore(tmp_path / "kv")
    store.put(block)
    target = store.path(v1_key)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(_version_1(old))
    store.close()
    (tmp_path / "kv" / "index.sqlite").unlink()  # lost: the next start rebuilds from the files
    store = LocalDirStore(tmp_path / "kv")
    assert store.run_length([block.key]) == 1 and store.run_length([v1_key]) == 0
    assert (store.rebuilt.kept, store.rebuilt.dropped, store.rebuilt.other_version) == (1, 0, 1)
    assert not target.exists()
    assert _same(store.get(block.key), block)
    store.close()


def test_the_checksum_is_xxh3_128_of_the_sorted_metadata_then_k_v_and_token_ids():
    """The file format, computed here in one shot: the writer's stream (a strided ``k`` fed
    plane by plane) and the reader's chunked one must both be exactly these bytes in this order."""
    import json

    import xxhash

    block = _block(dataclasses.replace(SHAPE, dtype=torch.bfloat16))
    tokens = torch.tensor(block.tokens)
    md = metadata(block, tokens)
    facts = {n: f for n, f in md.items() if n != "checksum"}
    raw = json.dumps(facts, sort_keys=True).encode() + b"".join(
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in (block.k, block.v, tokens)
    )
    assert md["checksum"] == "xxh3-128:" + xxhash.xxh3_128(raw).hexdigest()
    wide = torch.zeros(2, 2, 3 * BLOCK_TOKENS, 8, dtype=torch.bfloat16)
    wide[:, :, BLOCK_TOKENS : 2 * BLOCK_TOKENS] = block.k
    strided = dataclasses.replace(block, k=wide[:, :, BLOCK_TOKENS : 2 * BLOCK_TOKENS])
    assert not strided.k.is_contiguous() and metadata(strided, tokens) == md


def test_payload_with_a_wrong_checksum_is_refused(tmp_path):
    block = _block()
    tokens = torch.tensor(block.tokens)
    md = metadata(block, tokens)
    k = block.k.clone()
    k[1, 0, 7, 3] += 1.0
    (tmp_path / "b").write_bytes(save({"k": k, "v": block.v, "tokens": tokens}, metadata=md))
    with pytest.raises(BlockError, match="checksum"):
        decode_block(str(tmp_path / "b"), block.key)


ENCODED = {
    dt: encode_block(_block(dataclasses.replace(SHAPE, dtype=dt))) for dt in (torch.float32, torch.bfloat16)
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(sorted(ENCODED, key=str)),
    flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(1, 255)), min_size=1, max_size=3),
)
def test_flipped_bytes_are_refused_or_harmless(tmp_path, dtype, flips):
    """Every corruption is detected, except one that changes nothing read back (JSON whitespace)."""
    data = bytearray(ENCODED[dtype])
    for pos, mask in flips:
        data[pos % len(data)] ^= mask
    path = tmp_path / "b.safetensors"
    path.write_bytes(bytes(data))
    want = _block(dataclasses.replace(SHAPE, dtype=dtype))
    try:
        got = decode_block(str(path), want.key)
    except BlockError:
        return
    assert _same(got, want)


def _metadata_of(data: bytes) -> dict[str, str]:
    import json

    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bit=st.integers(min_value=0), field=st.sampled_from(sorted(_metadata_of(ENCODED[torch.float32]))))
def test_one_flipped_bit_of_k_v_tokens_or_a_metadata_field_is_refused(tmp_path, bit, field):
    """One bit anywhere in the payload (``k``, ``v``, ``tokens``), or in any metadata field's
    value, and the file is refused: nothing the checksum covers can change unseen."""
    data = ENCODED[torch.float32]
    header = 8 + int.from_bytes(data[:8], "little")
    path = tmp_path / "b.safetensors"
    payload = bytearray(data)
    payload[header + (bit // 8) % (len(data) - header)] ^= 1 << (bit % 8)
    path.write_bytes(bytes(payload))
    with pytest.raises(BlockError, match="checksum"):
        decode_block(str(path), _block().key)
    value = _metadata_of(data)[field]
    at = (bit // 7) % len(value)
    flipped = value[:at] + chr(ord(value[at]) ^ (1 << (bit % 7))) + value[at + 1 :]  # ASCII stays ASCII
    path.write_bytes(_reheader(data, lambda h: h | {"__metadata__": h["__metadata__"] | {field: flipped}}))
    with pytest.raises(BlockError):
        decode_block(str(path), _block().key)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0), extra=st.binary(max_size=64))
def test_truncated_or_extended_files_are_refused(tmp_path, cut, extra):
    data = ENCODED[torch.float32]
    path = tmp_path / "b.safetensors"
    path.write_bytes(data[: cut % len(data)])
    with pytest.raises(BlockError):
        decode_block(str(path), _block().key)
    if extra:
        path.write_bytes(data + extra)
        try:
            got = decode_block(str(path), _block().key)
        except BlockError:
            return
        assert _same(got, _block())


def test_decode_into_rows_of_a_longer_segment(tmp_path):
    """The loader reads a block straight into its rows of the segment it assembles."""
    block = _block(dataclasses.replace(SHAPE, dtype=torch.bfloat16))
    path = tmp_path / "b.safetensors"
    path.write_bytes(encode_block(block))
    seg_k = torch.zeros(2, 2, 3 * BLOCK_TOKENS, 8, dtype=torch.bfloat16)
    seg_v = torch.zeros_like(seg_k)
    rows = slice(BLOCK_TOKENS, 2 * BLOCK_TOKENS)
    got = decode_block(str(path), block.key, into=(seg_k[:, :, rows], seg_v[:, :, rows]))
    assert _same(got, block) and got.k.data_ptr() == seg_k[:, :, rows].data_ptr()
    assert torch.equal(seg_k[:, :, rows], block.k) and not seg_k[:, :, :BLOCK_TOKENS].any()
    wrong = torch.zeros(2, 2, BLOCK_TOKENS, 8)  # a float32 segment cannot take bf16 rows
    with pytest.raises(BlockError, match="bfloat16"):
        decode_block(str(path), block.key, into=(wrong, wrong.clone()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chunk=st.integers(min_value=1, max_value=40000),  # a plane here is 4 KiB
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    at=st.integers(0, 2),
    flip=st.one_of(st.none(), st.integers(min_value=0)),
)
def test_chunked_reads_into_segment_rows_are_exact_or_refused(
    tmp_path, monkeypatch, chunk, layers, heads, at, flip
):
    """The reader streams ``k``/``v`` in chunks of ``CHUNK`` bytes (one plane or many; a chunk
    boundary anywhere) into strided rows of a longer segment: the rows read are the block's bits,
    the rest of the segment is untouched, and a flipped payload byte is always refused."""
    monkeypatch.setattr(disk_blocks, "CHUNK", chunk)
    shape = KVShape(layers, heads, 8, torch.bfloat16, CPU)
    block = _block(shape, seed=chunk)
    data = bytearray(encode_block(block))
    header = 8 + int.from_bytes(data[:8], "little")
    if flip is not None:
        data[header + flip % (len(data) - header)] ^= 0x10
    path = tmp_path / "b.safetensors"
    path.write_bytes(bytes(data))
    seg_k = torch.full((layers, heads, 3 * BLOCK_TOKENS, 8), 7.0, dtype=torch.bfloat16)
    seg_v = seg_k.clone()
    rows = slice(at * BLOCK_TOKENS, (at + 1) * BLOCK_TOKENS)
    if flip is not None:
        with pytest.raises(BlockError, match="checksum"):
            decode_block(str(path), block.key, into=(seg_k[:, :, rows], seg_v[:, :, rows]))
        return
    got = decode_block(str(path), block.key, into=(seg_k[:, :, rows], seg_v[:, :, rows]))
    assert (
        _same(got, block)
        and torch.equal(seg_k[:, :, rows], block.k)
        and torch.equal(seg_v[:, :, rows], block.v)
    )
    rest = torch.ones(3 * BLOCK_TOKENS, dtype=torch.bool)
    rest[rows] = False
    assert (seg_k[:, :, rest] == 7).all() and (seg_v[:, :, rest] == 7).all()


def _reheader(data: bytes, change) -> bytes:
    """``data`` (a block file) with its JSON header replaced by ``change(header)``'s."""
    import json

    n = int.from_bytes(data[:8], "little")
    header = change(json.loads(data[8 : 8 + n]))
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


@pytest.mark.parametrize(
    "change",
    [
        lambda h: h | {"__metadata__": h["__metadata__"] | {"depth": [0]}},  # not a string
        lambda h: h | {"__metadata__": [1, 2]},
        lambda h: h | {"k": h["k"] | {"dtype": ["BF16"]}},
        lambda h: h | {"k": h["k"] | {"data_offsets": [0, 1.5]}},
        lambda h: h | {"v": h["v"] | {"data_offsets": h["k"]["data_offsets"]}},  # overlapping tensors
    ],
    ids=["metadata-list-value", "metadata-list", "dtype-list", "float-offset", "overlap"],
)
def test_headers_that_safetensors_would_not_write_are_refused(tmp_path, change):
    """The reader parses the header itself: anything but what the library writes is a BlockError."""
    block = _block()
    path = tmp_path / "b.safetensors"
    path.write_bytes(_reheader(encode_block(block), change))
    with pytest.raises(BlockError):
        decode_block(str(path), block.key)


def test_a_file_of_empty_k_and_v_is_refused(tmp_path):
    """k and v of shape [0, 2, 256, 8] (no bytes) and the token ids: a header that tiles its data."""
    import json

    block = _block()
    data = encode_block(block)
    n = int.from_bytes(data[:8], "little")
    h = json.loads(data[8 : 8 + n])
    lo, hi = h["tokens"]["data_offsets"]
    ids = data[8 + n + lo : 8 + n + hi]
    empty = {"dtype": "F32", "shape": [0, 2, BLOCK_TOKENS, 8], "data_offsets": [0, 0]}
    h |= {"k": empty, "v": empty, "tokens": h["tokens"] | {"data_offsets": [0, len(ids)]}}
    raw = json.dumps(h).encode()
    path = tmp_path / "b.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + ids)
    with pytest.raises(BlockError, match="not a block"):
        decode_block(str(path), block.key)
