"""A lost or damaged disk index: the blocks are kept, the index is rebuilt from them, serving goes on.

Each case damages the ``index.sqlite`` of a directory that a bank wrote (six blocks of one
conversation) as a disk or a person does: removed, emptied, truncated, a garbage header, a garbage
page. Opening the tier again (what a restarted server does) moves the damaged index aside,
rebuilds it from the block files, verifying each, logs one line with the counts, and answers the
follow-up from disk: ``cached_tokens`` covers the six blocks and the greedy text is that of a run
without any cache. ``turnkv cache`` reports such an index in one line with exit code 1 (``stats``,
``verify``), clears it (``clear``) or rebuilds it (``repair``). A crash in the middle of a rebuild
leaves a directory that the next start rebuilds again.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from disk_helpers import GIB, bank_over, prompt, tiny_engine, turn

from turnkv.bank.disk_blocks import BLOCK_TOKENS as B
from turnkv.bank.disk_store import LocalDirStore
from turnkv.bank.session_bank import SessionBank
from turnkv.cli import main as turnkv_main
from turnkv.kv.segments import unique_bytes

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = 6


def _overwrite(path: Path, offset: int, n: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(random.Random(offset).randbytes(n))


DAMAGES = {
    "missing": lambda p: p.unlink(),
    "empty": lambda p: p.write_bytes(b""),
    "truncated": lambda p: os.truncate(p, p.stat().st_size // 2),
    "garbage_header": lambda p: _overwrite(p, 0, 100),
    "garbage_page": lambda p: _overwrite(p, 4096, 4096),  # page 2: the blocks table
}


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def written(engine, tmp_path_factory):
    """A directory holding one conversation's six blocks (the tier closed cleanly), the follow-up
    the client sends next, and the greedy answer to it without any cache."""
    directory = tmp_path_factory.mktemp("written")
    bank = bank_over(engine, directory)
    turn(engine, bank, "ns", prompt(BLOCKS * B + 40))
    [entry] = bank.entries()
    bank.tier.close()
    assert not (directory / "index.sqlite-wal").exists()  # a clean close leaves the main file only
    follow = [*entry.tokens, *prompt(30, seed=5)]
    plain = SessionBank(GIB, engine.shape.bytes_per_row, lambda held: unique_bytes(*held))
    return directory, follow, turn(engine, plain, "ns", follow, max_tokens=8)[0]


def damaged(written, tmp_path: Path, damage: str) -> Path:
    directory = tmp_path / "kv"
    shutil.copytree(written[0], directory)
    DAMAGES[damage](directory / "index.sqlite")
    return directory


def block_files(directory: Path) -> list[Path]:
    return sorted((directory / "blocks").rglob("*.safetensors"))


def rebuild_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "turnkv.bank.disk_index"]


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_index_keeps_every_block_and_the_restarted_tier_serves_from_them(
    engine, written, tmp_path, damage, caplog
):
    directory = damaged(written, tmp_path, damage)
    files = block_files(directory)
    assert len(files) == BLOCKS
    caplog.set_level(logging.INFO, logger="turnkv.bank.disk_index")
    bank = bank_over(engine, directory)  # a restarted server over the same directory
    assert bank.tier.store.count == BLOCKS and block_files(directory) == files
    [line] = rebuild_lines(caplog)
    assert f"{BLOCKS} kept, 0 dropped" in line and " s" in line, line
    aside = sorted(p.name for p in directory.glob("index.sqlite.damaged-*"))
    assert len(aside) == (0 if damage in ("missing", "empty") else 1)  # nothing to keep of those
    answer, stats, cached = turn(engine, bank, "ns", written[1], max_tokens=8)
    assert cached == BLOCKS * B and stats.cached_tokens == cached
    assert answer == written[2]  # the same greedy text as without any cache
    bank.tier.close()
    caplog.clear()
    again = LocalDirStore(directory)  # the rebuilt index is an ordinary one: no second rebuild
    assert again.count == BLOCKS and rebuild_lines(caplog) == []
    again.close()


def test_a_rebuild_drops_a_block_that_fails_its_checksum_and_counts_it(written, tmp_path, caplog):
    directory = damaged(written, tmp_path, "garbage_header")
    bad = block_files(directory)[2]
    data = bytearray(bad.read_bytes())
    data[-7] ^= 0x40
    bad.write_bytes(bytes(data))
    (bad.parent / f".{bad.stem}.1.0.tmp").write_bytes(b"half a block")  # a write a crash cut short
    caplog.set_level(logging.INFO, logger="turnkv.bank.disk_index")
    store = LocalDirStore(directory)
    assert store.count == BLOCKS - 1 and not bad.exists() and bad.stem not in {i.key for i in store.iterate()}
    assert (store.rebuilt.kept, store.rebuilt.dropped, store.rebuilt.temp_files) == (BLOCKS - 1, 1, 1)
    [line] = rebuild_lines(caplog)
    assert f"{BLOCKS - 1} kept, 1 dropped" in line
    assert not list(directory.rglob("*.tmp"))
    store.close()


def test_a_rebuilt_index_keeps_the_last_access_it_could_read_else_the_file_time(written, tmp_path):
    directory = damaged(written, tmp_path, "missing")
    store = LocalDirStore(directory)
    for info in store.iterate():
        assert info.last_access == pytest.approx(store.path(info.key).stat().st_mtime)
    store.touch([info.key for info in store.iterate()], at=1234.0)
    store.close()
    _overwrite(directory / "index.sqlite", 16384 - 1000, 1000)  # the end of the last page only
    store = LocalDirStore(directory)
    assert store.rebuilt is not None and store.count == BLOCKS
    assert {i.last_access for i in store.iterate()} == {1234.0}  # salvaged from the damaged rows
    store.close()


CRASH = """
import os, sys
from turnkv.bank import disk_index
where = sys.argv[2]
if where == "install":
    disk_index._install = lambda *a: os._exit(9)
else:
    seen = []
    verify = disk_index.verified_row
    def crash_on_the_third(*a):
        seen.append(1)
        if len(seen) == 3:
            os._exit(9)
        return verify(*a)
    disk_index.verified_row = crash_on_the_third
from turnkv.bank.disk_store import LocalDirStore
LocalDirStore(sys.argv[1])
"""


@pytest.mark.parametrize("where", ["scan", "install"])
def test_a_crash_in_the_middle_of_a_rebuild_leaves_a_state_the_next_start_rebuilds(written, tmp_path, where):
    directory = damaged(written, tmp_path, "garbage_page")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run(
        [sys.executable, "-c", CRASH, str(directory), where], env=env, capture_output=True, timeout=120
    )
    assert child.returncode == 9, child.stderr
    assert not (directory / "index.sqlite").exists()  # moved aside before the rebuild began
    assert len(list(directory.glob("index.sqlite.damaged-*"))) == 1
    store = LocalDirStore(directory)
    assert store.rebuilt is not None and (store.rebuilt.kept, store.rebuilt.dropped) == (BLOCKS, 0)
    assert store.count == BLOCKS and len(block_files(directory)) == BLOCKS
    assert sorted(p.name for p in directory.iterdir() if "rebuild" in p.name) == []  # no temp index left
    store.close()


def cache(capsys, *args: str) -> tuple[int, str, list[str]]:
    """``turnkv cache ARGS`` in this process: (exit code, stdout, stderr lines)."""
    capsys.readouterr()
    code = turnkv_main(["cache", *args])
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_cache_stats_verify_and_repair_on_a_damaged_index(written, tmp_path, damage, capsys):
    directory = damaged(written, tmp_path, damage)
    d = str(directory)
    before = sorted(p.name for p in directory.rglob("*"))
    for action in ("stats", "verify"):
        code, out, err = cache(capsys, action, "--disk-dir", d)
        assert code == 1 and out == "" and len(err) == 1, (action, out, err)
        assert "index" in err[0] and "turnkv cache repair" in err[0] and f"{BLOCKS} block files" in err[0]
    code, out, err = cache(capsys, "verify", "--disk-dir", d, "--json")
    assert code == 1 and json.loads(out)["error"] in err[0]
    assert sorted(p.name for p in directory.rglob("*")) == before  # reporting changed nothing

    code, out, err = cache(capsys, "repair", "--disk-dir", d, "--json")
    report = json.loads(out)
    assert code == 0, (out, err)
    assert (report["kept"], report["dropped"], report["bad_entries"]) == (BLOCKS, 0, 0)
    assert report["other_version"] == 0  # (a version-1 file would be counted here: test_disk_versions)
    assert report["index"] != "ok" and (report["moved_to"] is None) == (damage in ("missing", "empty"))
    code, out, _ = cache(capsys, "verify", "--disk-dir", d, "--json")
    assert code == 0 and json.loads(out)["good"] == BLOCKS
    code, out, _ = cache(capsys, "stats", "--disk-dir", d, "--json")
    assert code == 0 and json.loads(out)["blocks"] == BLOCKS
    assert cache(capsys, "repair", "--disk-dir", d)[0] == 0  # a sound index: rebuilt all the same


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_cache_clear_on_a_damaged_index_removes_every_block(written, tmp_path, damage, capsys):
    directory = damaged(written, tmp_path, damage)
    size = sum(p.stat().st_size for p in block_files(directory))
    code, out, err = cache(capsys, "clear", "--disk-dir", str(directory), "--json")
    assert code == 0, err
    assert json.loads(out) | {"dir": ""} == {"dir": "", "removed_blocks": BLOCKS, "freed_bytes": size}
    assert block_files(directory) == []
    code, out, _ = cache(capsys, "stats", "--disk-dir", str(directory), "--json")
    assert code == 0 and json.loads(out)["blocks"] == 0


def test_cache_verify_exits_1_when_it_removed_anything(written, tmp_path, capsys):
    directory = tmp_path / "kv"
    shutil.copytree(written[0], directory)
    block_files(directory)[-1].unlink()  # a row whose file is gone
    code, out, _ = cache(capsys, "verify", "--disk-dir", str(directory), "--json")
    assert code == 1 and json.loads(out)["missing_files"] == 1 and json.loads(out)["bad"] == 0
    assert cache(capsys, "verify", "--disk-dir", str(directory))[0] == 0  # clean now
    temp = block_files(directory)[0].parent / ".leftover.1.0.tmp"
    temp.write_bytes(b"x")
    code, out, _ = cache(capsys, "verify", "--disk-dir", str(directory), "--json")
    assert code == 1 and json.loads(out)["temp_files"] == 1


def test_turnkv_cache_verify_of_a_garbage_index_is_one_line_without_a_traceback(written, tmp_path):
    directory = damaged(written, tmp_path, "garbage_header")
    proc = subprocess.run(
        [sys.executable, "-m", "turnkv", "cache", "verify", "--disk-dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("turnkv: error:") and "damaged" in line and "turnkv cache repair" in line


@pytest.mark.slow
def test_a_restarted_http_server_answers_the_follow_up_from_a_rebuilt_index(default_model, tmp_path):
    from test_server import SYSTEM, Live, chat

    loaded = default_model
    facts = " ".join(f"Fact {i}: river {i} flows into lake {i * 7 % 13}." for i in range(24))
    msgs = [SYSTEM, {"role": "user", "content": facts + " Which lake does river 5 flow into?"}]
    first = Live(loaded, disk_dir=str(tmp_path))
    r = chat(first.client(), msgs)
    first.idle()
    first.close()
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}]
    msgs += [{"role": "user", "content": "And river 6?"}]
    DAMAGES["garbage_page"](tmp_path / "index.sqlite")

    second = Live(loaded, disk_dir=str(tmp_path))  # the restart rebuilds the index
    r2 = chat(second.client(), msgs)
    h = second.health()["disk"]
    # the same conversation in a namespace of its own: nothing cached, computed from scratch
    want = chat(second.client(), msgs, extra_body={"cache_salt": "elsewhere"})
    second.close()
    assert h["enabled"] is True and h["hits"] == 1 and h["corrupt"] == 0
    assert r2.usage.prompt_tokens_details.cached_tokens >= B
    assert want.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.choices[0].message.content == want.choices[0].message.content
