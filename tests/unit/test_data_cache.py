"""The parsed-data cache (trainer/data/cache.py) and the data fingerprint (trainer/data/fingerprint.py), on real
files: parsed once, memory-mapped after; other data or settings never served from an entry built for something
else; a damaged entry rebuilt; one rank of a node builds while the others wait (and learn of its failure); a
large file parsed in a child process whose error still names the file and line; a cache that cannot be written
refused with the way out."""
from __future__ import annotations

import logging
import os
import threading

import numpy as np
import pytest

from trainer.data import cache, fingerprint, owners
from trainer.recipes.sasrec import data as D
from trainer.recipes.sasrec.config import SeqDataConfig


def udata(path, rows):
    path.write_text("".join(f"{u}\t{i}\t5\t{t}\n" for u, i, t in rows))
    return path


ROWS = [(u, i, 100 * u + i) for u in range(1, 7) for i in range(1, 6)]


def entries(root):
    return sorted(p.name for p in root.glob("sasrec-*"))


def test_parsed_once_then_memory_mapped_equal_to_a_fresh_parse(tmp_path, caplog):
    path = udata(tmp_path / "u.data", ROWS)
    cfg = SeqDataConfig(path=str(path), cache=str(tmp_path / "cache"))
    caplog.set_level(logging.INFO)
    first = D.load(cfg)
    assert "parsing the data into the cache" in caplog.text
    second = D.load(cfg)
    assert "memory-mapped" in caplog.text and isinstance(second.seqs.flat, np.memmap)
    fresh = D.load(SeqDataConfig(path=str(path), cache="off"))
    for got in (first, second):
        assert got.num_items == fresh.num_items and got.num_users == fresh.num_users
        for a, b in ((got.seqs, fresh.seqs), (got.times, fresh.times)):
            assert np.array_equal(a.flat, b.flat) and np.array_equal(a.offsets, b.offsets)
    assert len(entries(tmp_path / "cache")) == 1 and list((tmp_path / "cache" / "fingerprints").glob("*.json"))


def test_changed_data_or_settings_are_never_served_from_the_old_entry(tmp_path):
    path = udata(tmp_path / "u.data", ROWS)
    root = tmp_path / "cache"
    before = D.load(SeqDataConfig(path=str(path), cache=str(root)))
    old = entries(root)
    udata(path, [(u, i if u != 1 else 7 - i, t) for u, i, t in ROWS])     # same size, other content
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    after = D.load(SeqDataConfig(path=str(path), cache=str(root)))
    assert not np.array_equal(after.seqs[0], before.seqs[0])
    assert np.array_equal(after.seqs[0], D.load(SeqDataConfig(path=str(path), cache="off")).seqs[0])
    assert len(entries(root)) == 2 and old[0] in entries(root)          # kept: another job may map it
    D.load(SeqDataConfig(path=str(path), cache=str(root), kcore=2))       # another setting: another entry
    assert len(entries(root)) == 3


def test_a_damaged_entry_is_rebuilt(tmp_path):
    path = udata(tmp_path / "u.data", ROWS)
    cfg = SeqDataConfig(path=str(path), cache=str(tmp_path / "cache"))
    D.load(cfg)
    items = next((tmp_path / "cache").glob("sasrec-*/items.npy"))
    items.write_bytes(items.read_bytes()[:-16])                           # truncated
    again = D.load(cfg)
    assert np.array_equal(again.seqs.flat, D.load(SeqDataConfig(path=str(path), cache="off")).seqs.flat)


def test_past_the_cap_only_entries_without_a_live_lease_go_oldest_first(tmp_path):
    path = udata(tmp_path / "u.data", ROWS)
    root = tmp_path / "cache"
    for kcore in (0, 2, 3):                              # three entries, oldest first; this process leases all
        D.load(SeqDataConfig(path=str(path), cache=str(root), kcore=kcore))
    names = [e.path.name for e in cache.entries_of(root)]
    D.load(SeqDataConfig(path=str(path), cache=str(root), kcore=4, cache_cap_gb=1e-9))
    cache.evict_pending()                                # as the engine does once the run is not refused
    assert len(entries(root)) == 4                       # every one is leased: none removed
    owners._LEASES.release_all()                         # as if the jobs that mapped them had ended
    (root / cache.LEASES / names[1]).mkdir(parents=True, exist_ok=True)
    other = root / cache.LEASES / names[1] / "node9.4242.abc.lease"   # another node's job, heard of just now
    other.write_text('{"node": "node9", "host": "h", "pid": 4242, "job": "7", "launch": "x", "started": 0, '
                     '"token": "abc"}')
    D.load(SeqDataConfig(path=str(path), cache=str(root), kcore=5, cache_cap_gb=1e-9))
    assert len(entries(root)) == 5                       # nothing removed before the run is not refused
    cache.evict_pending()
    left = entries(root)
    assert names[0] not in left and names[2] not in left  # leaseless, oldest first: gone
    assert names[1] in left and len(left) == 2           # leased by another node's live job, and the one mapped now
    stale = os.path.getmtime(other) - owners.LEASE_STALE_S - 5
    os.utime(other, (stale, stale))                      # that job's heartbeat stopped
    D.load(SeqDataConfig(path=str(path), cache=str(root), duplicates="keep", cache_cap_gb=1e-9))
    cache.evict_pending()
    assert names[1] not in entries(root) and not other.exists()


def test_one_rank_builds_while_the_others_of_its_node_wait(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cache, "REPORT_S", 0.2)
    path = udata(tmp_path / "u.data", ROWS)
    cfg = SeqDataConfig(path=str(path), cache=str(tmp_path / "cache"))
    caplog.set_level(logging.INFO)
    got: dict[int, object] = {}
    waiter = threading.Thread(target=lambda: got.__setitem__(1, D.load(cfg, local_rank=1)))
    waiter.start()
    waiter.join(0.6)
    assert waiter.is_alive() and "waiting for local rank 0" in caplog.text    # nothing built without rank 0
    got[0] = D.load(cfg, local_rank=0)
    waiter.join(30)
    assert np.array_equal(got[0].seqs.flat, got[1].seqs.flat)


def test_a_failed_build_stops_the_waiting_ranks_with_its_error(tmp_path):
    path = tmp_path / "u.data"
    path.write_text("1\t2\t5\t100\n1\tx\t5\t101\n")
    cfg = SeqDataConfig(path=str(path), cache=str(tmp_path / "cache"))
    with pytest.raises(D.DataError, match=r"u.data:2: field 'item': 'x' is not an integer"):
        D.load(cfg, local_rank=0)
    with pytest.raises(D.DataError, match=r"build failed on local rank 0: .*u.data:2: field 'item'"):
        D.load(cfg, local_rank=1)


def test_a_large_file_is_parsed_in_a_child_whose_error_names_the_line(tmp_path, monkeypatch):
    """Where this process's malloc keeps freed memory (reuse_freed_memory ran: a second run in one process)."""
    monkeypatch.setattr(cache, "CHILD_FROM", 1)
    monkeypatch.setattr(cache.memory, "keeps_freed_memory", lambda: True)
    spawned = []
    real = cache.multiprocessing.get_context
    monkeypatch.setattr(cache.multiprocessing, "get_context", lambda how: spawned.append(how) or real(how))
    path = udata(tmp_path / "u.data", ROWS)
    cfg = SeqDataConfig(path=str(path), cache=str(tmp_path / "cache"))
    assert np.array_equal(D.load(cfg).seqs.flat, D.load(SeqDataConfig(path=str(path), cache="off")).seqs.flat)
    path.write_text(path.read_text() + "7\t-3\t5\t1\n")
    with pytest.raises(D.DataError, match=r"u.data:31: field 'item': '-3' is a negative id"):
        D.load(cfg)
    assert spawned == ["spawn", "spawn"]


def test_a_large_file_is_parsed_in_process_before_malloc_keeps_freed_memory(tmp_path, monkeypatch):
    """The engine builds the data before reuse_freed_memory: no child process to start then."""
    monkeypatch.setattr(cache, "CHILD_FROM", 1)
    monkeypatch.setattr(cache.memory, "keeps_freed_memory", lambda: False)
    monkeypatch.setattr(cache.multiprocessing, "get_context", lambda how: pytest.fail("a child was started"))
    path = udata(tmp_path / "u.data", ROWS)
    assert D.load(SeqDataConfig(path=str(path), cache=str(tmp_path / "cache"))).num_users == 6


def test_a_cache_that_cannot_be_created_is_refused_with_the_way_out(tmp_path):
    path = udata(tmp_path / "u.data", ROWS)
    (tmp_path / "file").write_text("")
    from trainer.launch.exitcodes import DiskError  # a file the run must write: exit 4, not a usage error
    with pytest.raises(DiskError, match=r"(?s)cannot create it.*data.cache=off"):
        D.load(SeqDataConfig(path=str(path), cache=str(tmp_path / "file" / "cache")))


def test_the_fingerprint_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    path = udata(tmp_path / "u.data", ROWS)
    memo = tmp_path / "memo"
    digest = fingerprint.fingerprint(path, memo)
    reads = []
    monkeypatch.setattr(fingerprint, "sha256_of", lambda p: reads.append(p) or "rehashed")
    assert fingerprint.fingerprint(path, memo) == digest and not reads     # warm: the file is not read
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert fingerprint.fingerprint(path, memo) == "rehashed" and reads == [path]


def test_loader_workers_get_the_mapped_file_not_a_copy(tmp_path):
    import pickle
    path = udata(tmp_path / "u.data", ROWS * 50)
    data = D.load(SeqDataConfig(path=str(path), cache=str(tmp_path / "cache"), duplicates="keep"))
    blob = pickle.dumps(data.seqs)
    again = pickle.loads(blob)
    assert len(blob) < data.seqs.flat.nbytes / 4 and isinstance(again.flat, np.memmap)
    assert np.array_equal(again.flat, data.seqs.flat) and np.array_equal(again.offsets, data.seqs.offsets)


def test_kgat_folders_are_cached_too_and_their_warnings_said_again(tmp_path, caplog):
    from trainer.recipes.kgat import data as KG
    folder = tmp_path / "kg"
    folder.mkdir()
    (folder / "train.txt").write_text("0 1 2 2 3\n1 0 4\n2 3\n")
    (folder / "test.txt").write_text("0 4\n1 2 3\n")
    (folder / "kg_final.txt").write_text("0 0 5\n1 1 6\n4 0 5\n")
    fresh = KG.load(folder)
    caplog.set_level(logging.INFO)
    for _ in range(2):                                   # cold, then warm
        caplog.clear()
        got = KG.load_cached(folder, cache_setting=str(tmp_path / "cache"))
        assert "1 duplicate interaction(s)" in caplog.text
        assert [t.tolist() for t in got.train] == [t.tolist() for t in fresh.train]
        assert [t.tolist() for t in got.test] == [t.tolist() for t in fresh.test]
        assert np.array_equal(got.kg, fresh.kg) and (got.n_items, got.n_entities, got.n_relations) == \
            (fresh.n_items, fresh.n_entities, fresh.n_relations)
    assert "memory-mapped" in caplog.text and "said when the data was parsed" in caplog.text
    (folder / "kg_final.txt").write_text("0 0 5\n1 1 6\n4 0 6\n")   # changed: parsed again
    assert KG.load_cached(folder, cache_setting=str(tmp_path / "cache")).kg[2, 2] == 6


def test_har_text_formats_are_cached_as_flat_series(tmp_path, caplog):
    """UCI HAR and .ts splits go through the same cache: the warm start maps the flat values, and the windows equal
    a fresh parse's; a changed file is parsed again."""
    from trainer.recipes.har import data as HD
    from trainer.recipes.har import prepare as HP
    root = HP.write_synthetic_uci(tmp_path / "uci", 40, 12)
    caplog.set_level(logging.INFO)
    fresh = HP.load(HP.HARDataConfig(path=str(root), cache="off"))
    for _ in range(2):
        got = HP.load(HP.HARDataConfig(path=str(root), cache=str(tmp_path / "cache")))
        for split in fresh.splits:
            assert np.array_equal(got.splits[split].x.numpy(), fresh.splits[split].x.numpy())
            assert np.array_equal(got.splits[split].subjects.numpy(), fresh.splits[split].subjects.numpy())
        assert got.class_names == fresh.class_names
    assert "memory-mapped" in caplog.text and len(list((tmp_path / "cache").glob("har-*"))) == 1
    splits, _ = HP.read_splits_cached(HP.HARDataConfig(path=str(root), cache=str(tmp_path / "cache")))
    assert isinstance(splits["train"].values, np.memmap)
    ts = tmp_path / "ts"
    ts.mkdir()
    header = "@problemName toy\n@univariate true\n@equalLength false\n@classLabel true a b\n@data\n"
    (ts / "toy_TRAIN.ts").write_text(header + "1,2,3:a\n4,5:b\n1,1,1,1:a\n")
    cfg = HP.HARDataConfig(path=str(ts), cache=str(tmp_path / "cache"), val_fraction=0)
    assert HP.read_splits_cached(cfg)[0]["train"].lengths.tolist() == [3, 2, 4]
    (ts / "toy_TRAIN.ts").write_text(header + "1,2,3:a\n4,5,6,7,8:b\n")
    assert HP.read_splits_cached(cfg)[0]["train"].lengths.tolist() == [3, 5]
    assert HD.Series is type(splits["train"])


def test_the_data_cache_command_lists_and_clears_only_what_no_job_maps(tmp_path):
    from tests.inprocess import cli
    path = udata(tmp_path / "u.data", ROWS)
    root = tmp_path / "cache"
    for kcore in (0, 2):
        D.load(SeqDataConfig(path=str(path), cache=str(root), kcore=kcore))      # this process maps both
    listed = cli("data", "cache", "list", "--root", str(root)).stdout
    assert listed.count("mapped by: pid ") == 2 and f"pid {os.getpid()} on " in listed
    assert "removed 0 entries" in cli("data", "cache", "clear", "--root", str(root)).stdout
    assert len(entries(root)) == 2
    owners._LEASES.release_all()
    assert "removed 2 entries" in cli("data", "cache", "clear", "--root", str(root)).stdout
    assert entries(root) == []


def test_a_full_disk_under_the_cache_is_a_resource_error_naming_the_entry(tmp_path):
    """numpy's OSError on a full disk carries no errno: it was a traceback, exit 1, retried for ever."""
    import subprocess

    from trainer.engine.exits import exit_of
    from trainer.launch.exitcodes import DiskError
    root = tmp_path / "cache"
    root.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(root)]).returncode:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    try:
        path = udata(tmp_path / "u.data", [(u, i, 100 * u + i) for u in range(1, 400) for i in range(1, 30)])
        with pytest.raises(DiskError) as err:
            D.load(SeqDataConfig(path=str(path), cache=str(root)))
        assert exit_of(err.value).code == 4 and "could not write the data cache entry" in str(err.value)
        assert "KiB free there" in str(err.value) and "data.cache=off" in str(err.value)
        assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]      # no partial entry left behind
    finally:
        subprocess.run(["umount", "-l", str(root)])
