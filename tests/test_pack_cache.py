"""The packed-weights cache (models/pack_cache.py) as a spec: a second load of a GGUF takes its
packed weights from the cache, bit for bit what a fresh pack gives; a changed file (mtime, size,
content), packer version, kernel or ``--weights`` mode misses; a damaged cache file is detected,
never used, removed and rebuilt; two processes starting at once both load and leave one whole
file; ``TURNKV_PACK_CACHE=off`` turns it off."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_quant
import torch
from safetensors import safe_open
from test_quant import logits, tiny_gguf

from turnkv import cbuild
from turnkv.models import cpu_int4, pack_cache, quant
from turnkv.models.load import ModelLoadError, load_model

pytestmark = pytest.mark.skipif(quant.kernel_missing() is not None, reason="no int4 CPU kernel in torch")
kernel = test_quant.kernel  # the C kernel and torch's int4 kernel
IDS = [5, 77, 300, 12, 9, 250, 31, 100]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """This test's own cache root; the packed files are under ``cache / "packed"``."""
    monkeypatch.setenv("TURNKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(pack_cache.SETTING, raising=False)
    return tmp_path / "cache"


def gguf_file(tmp_path: Path, type_name: str = "Q4_1", tied: bool = True) -> Path:
    path = tmp_path / f"tiny-{type_name}-{'tied' if tied else 'untied'}.gguf"
    tiny_gguf(path, type_name, tied)
    return path


def load(path: Path, weights: str = "auto"):
    return load_model(str(path), device="cpu", dtype="float32", progress=False, weights=weights)


def packed_state(loaded) -> dict:
    """Every packed weight's buffers and flags, by module name."""
    out = {}
    for name, mod in loaded.model.named_modules():
        if isinstance(mod, quant.QuantWeight):
            flags = (mod.shape, mod.block_type, mod.native, mod.wide_ok)
            out[name] = (flags, mod.packed, mod.scale_zeros, mod.blocks)
    return out


def assert_same_weights(a, b) -> None:
    sa, sb = packed_state(a), packed_state(b)
    assert sa.keys() == sb.keys() and sa
    for name in sa:
        assert sa[name][0] == sb[name][0], name
        for x, y in zip(sa[name][1:], sb[name][1:], strict=True):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name
    assert (a.weights, a.weights_note, a.matmul) == (b.weights, b.weights_note, b.matmul)


def files(cache: Path) -> list[Path]:
    folder = cache / "packed"
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


@pytest.mark.parametrize(("type_name", "tied"), [("Q4_1", True), ("Q8_0", False), ("Q4_0", True)])
def test_a_second_load_hits_and_is_bit_identical_to_a_fresh_pack(
    cache, tmp_path, monkeypatch, kernel, type_name, tied
):
    path = gguf_file(tmp_path, type_name, tied)
    first = load(path)
    assert (first.pack_cache, first.weights) == ("miss", "packed") and len(files(cache)) == 1
    second = load(path)
    assert second.pack_cache == "hit"
    monkeypatch.setenv(pack_cache.SETTING, "off")
    fresh = load(path)
    assert fresh.pack_cache == "off"
    assert_same_weights(second, fresh)
    assert_same_weights(first, fresh)
    for rows in (IDS, IDS * 40):  # one narrow window; one wide window (torch's kernel: its wide path)
        assert torch.equal(logits(second, rows), logits(fresh, rows))


def test_a_changed_file_misses_and_its_old_entry_goes(cache, tmp_path):
    path = gguf_file(tmp_path)
    old = load(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same bytes, new mtime
    assert load(path).pack_cache == "miss" and len(files(cache)) == 1
    with path.open("ab") as f:  # grown: trailing bytes no tensor reads
        f.write(bytes(64))
    assert load(path).pack_cache == "miss" and len(files(cache)) == 1
    # the same size and mtime, one byte of a matrix changed: the content fingerprint differs
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x11
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size
    changed = load(path)
    assert changed.pack_cache == "miss" and len(files(cache)) == 1
    assert not torch.equal(logits(changed, IDS), logits(old, IDS))
    assert load(path).pack_cache == "hit"


def test_another_packer_version_kernel_or_weights_mode_misses(cache, tmp_path, monkeypatch):
    path = gguf_file(tmp_path)
    assert load(path).pack_cache == "miss"
    monkeypatch.setattr(pack_cache, "PACK_VERSION", pack_cache.PACK_VERSION + 1)
    assert load(path).pack_cache == "miss"
    assert load(path).pack_cache == "hit" and len(files(cache)) == 1  # the older version's file went
    assert load(path, weights="packed").pack_cache == "miss"  # a mode of its own: both kept
    assert len(files(cache)) == 2
    if cpu_int4.library() is None:
        return  # torch's int4 kernel already: no other kernel to switch to
    monkeypatch.setattr(cpu_int4.KERNEL, "lib", None)  # as TURNKV_CPU_KERNEL=off at start-up
    monkeypatch.setattr(cpu_int4.KERNEL, "why", "off (test)")
    switched = load(path)
    assert (switched.pack_cache, switched.matmul) == ("miss", "torch-int4") and len(files(cache)) == 3
    assert load(path).pack_cache == "hit"


DAMAGE = {
    "empty": lambda b: b"",
    "truncated to half": lambda b: b[: len(b) // 2],
    "one byte short": lambda b: b[:-1],
    "length prefix flipped": lambda b: _flip(b, 1),
    "header byte flipped": lambda b: _flip(b, 8 + _header_len(b) // 2),
    "header digit changed": lambda b: _swap_digit(b),
    "tensor byte flipped": lambda b: _flip(b, (8 + _header_len(b) + len(b)) // 2),
    "last byte flipped": lambda b: _flip(b, len(b) - 1),
}


def _header_len(b: bytes) -> int:
    return int.from_bytes(b[:8], "little")


def _flip(b: bytes, at: int) -> bytes:
    out = bytearray(b)
    out[at] ^= 0x40
    return bytes(out)


def _swap_digit(b: bytes) -> bytes:
    """A header that still parses: one digit of the stored facts' mtime changed."""
    end = 8 + _header_len(b)
    at = b.index(b"mtime_ns", 0, end) + len(b"mtime_ns") + 6
    while not chr(b[at]).isdigit():
        at += 1
    out = bytearray(b)
    out[at] = ord("1") if out[at] != ord("1") else ord("2")
    return bytes(out)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_cache_file_is_detected_removed_and_rebuilt(cache, tmp_path, monkeypatch, caplog, damage):
    path = gguf_file(tmp_path)
    load(path)
    (entry,) = files(cache)
    good = entry.read_bytes()
    entry.write_bytes(DAMAGE[damage](good))
    with caplog.at_level(logging.WARNING, logger=pack_cache.__name__):
        again = load(path)
    warnings = [r for r in caplog.records if r.name == pack_cache.__name__]
    assert again.pack_cache == "miss" and len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "packing again" in warnings[0].getMessage() and "\n" not in warnings[0].getMessage()
    assert files(cache) == [entry] and entry.stat().st_size == len(good)  # rebuilt, whole
    assert load(path).pack_cache == "hit"
    monkeypatch.setenv(pack_cache.SETTING, "off")
    assert torch.equal(logits(again, IDS), logits(load(path), IDS))


def test_a_crashed_writers_leftovers_are_never_read(cache, tmp_path):
    """A half-written temporary file is not a cache entry; one older than a day is cleaned up."""
    path = gguf_file(tmp_path)
    folder = cache / "packed"
    folder.mkdir(parents=True)
    stale, fresh = folder / ".tmp-old.safetensors", folder / ".tmp-live.safetensors"
    for f in (stale, fresh):
        f.write_bytes(b"{partial")
    os.utime(stale, (0, 0))
    assert load(path).pack_cache == "miss"
    assert not stale.exists() and fresh.exists()  # the recent one may be a writer still at work
    assert load(path).pack_cache == "hit"


CHILD = """
import hashlib, json, sys
from test_quant import logits
from turnkv.models.load import load_model
lm = load_model(sys.argv[1], device="cpu", dtype="float32", progress=False)
out = logits(lm, [5, 77, 300, 12]).numpy().tobytes()
print(json.dumps({"cache": lm.pack_cache, "logits": hashlib.sha256(out).hexdigest()}))
"""


def test_two_processes_starting_at_once_both_load_and_leave_one_whole_file(cache, tmp_path):
    path = gguf_file(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}  # for test_quant
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1].decode()[-2000:] for o in outs]
    got = [json.loads(o[0].decode().strip().splitlines()[-1]) for o in outs]
    assert got[0]["logits"] == got[1]["logits"]
    assert {g["cache"] for g in got} <= {"miss", "hit"}
    assert len(files(cache)) == 1 and not list((cache / "packed").glob(".tmp-*"))
    hit = load(path)
    assert hit.pack_cache == "hit"
    digest = hashlib.sha256(logits(hit, [5, 77, 300, 12]).numpy().tobytes()).hexdigest()
    assert digest == got[0]["logits"]


def test_the_cache_can_be_turned_off(cache, tmp_path, monkeypatch):
    path = gguf_file(tmp_path)
    monkeypatch.setenv(pack_cache.SETTING, "off")
    assert load(path).pack_cache == "off" and not files(cache)
    monkeypatch.setenv(pack_cache.SETTING, "sometimes")
    with pytest.raises(ModelLoadError) as err:
        load(path)
    assert pack_cache.SETTING in str(err.value) and "auto, on, off" in str(err.value)
    assert "\n" not in str(err.value)
    monkeypatch.setenv(pack_cache.SETTING, "on")
    assert load(path).pack_cache == "miss" and len(files(cache)) == 1
    assert load(path, weights="dequant").pack_cache == ""  # nothing packed, nothing cached


def test_the_cache_lives_beside_the_c_kernels(tmp_path, monkeypatch):
    """``$XDG_CACHE_HOME/turnkv/packed`` next to ``.../kernels``; ``TURNKV_CACHE_DIR`` moves it."""
    monkeypatch.delenv("TURNKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pack_cache.cache_dir() == tmp_path / "xdg" / "turnkv" / "packed"
    assert cbuild.cache_home() / "kernels" == tmp_path / "xdg" / "turnkv" / "kernels"
    monkeypatch.setenv("TURNKV_CACHE_DIR", str(tmp_path / "mine"))
    assert pack_cache.cache_dir() == tmp_path / "mine" / "packed"


def test_a_cache_that_cannot_be_written_is_skipped_with_a_warning(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("TURNKV_CACHE_DIR", str(blocker))
    path = gguf_file(tmp_path)
    with caplog.at_level(logging.WARNING, logger=pack_cache.__name__):
        loaded = load(path)
    assert (loaded.pack_cache, loaded.weights) == ("miss", "packed")
    assert [r.getMessage().split(" under ")[0] for r in caplog.records if r.name == pack_cache.__name__] == [
        "could not write the packed-weights cache"
    ]


def test_no_flipped_byte_of_the_header_and_no_sampled_byte_of_the_tensors_goes_unnoticed(cache, tmp_path):
    """Every byte of the length and header, and every 127th byte of the tensors, flipped in turn:
    ``read`` refuses each file (and removes it); the intact file reads back."""
    path = gguf_file(tmp_path)
    load(path)
    (entry,) = files(cache)
    good = entry.read_bytes()
    with safe_open(str(entry), framework="pt") as f:
        facts = json.loads(f.metadata()["facts"])
    assert pack_cache.read(facts) is not None
    end = 8 + _header_len(good)
    logging.getLogger(pack_cache.__name__).setLevel(logging.ERROR)  # one warning per file, thousands
    try:
        for at in [*range(end), *range(end, len(good), 127)]:
            entry.write_bytes(_flip(good, at))
            assert pack_cache.read(facts) is None and not entry.exists(), at
    finally:
        logging.getLogger(pack_cache.__name__).setLevel(logging.NOTSET)
    entry.write_bytes(good)
    assert pack_cache.read(facts) is not None
