"""DiskKVStore: round trip, damaged and foreign files are misses (and deleted), the quota's LRU eviction,
two stores (two processes) on one directory, unusable directories."""

from __future__ import annotations

import errno
import hashlib
import logging
import os

import pytest

from vlite.kv_connector.disk_store import DiskKVStore

PAYLOAD = 256


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int) -> bytes:
    return bytes((i + j) % 251 for j in range(PAYLOAD))


def read(store: DiskKVStore, block_hash: bytes, size: int = PAYLOAD) -> bytes | None:
    out = bytearray(size)
    return bytes(out) if store.load_into(block_hash, memoryview(out)) else None


@pytest.fixture
def store(tmp_path) -> DiskKVStore:
    s = DiskKVStore.open(str(tmp_path), "model-a", 1 << 30)
    assert s is not None
    return s


def test_round_trip_and_no_rewrite(store):
    assert not store.contains(h(1)) and read(store, h(1)) is None
    assert store.save(h(1), payload(1))
    assert store.contains(h(1)) and read(store, h(1)) == payload(1)
    assert not store.save(h(1), payload(2))  # the file exists: not rewritten
    assert read(store, h(1)) == payload(1)
    assert not [n for _, _, files in os.walk(store.root) for n in files if ".tmp." in n]  # no temporary left


def test_altered_byte_is_a_miss_and_the_file_goes(store, caplog):
    store.save(h(1), payload(1))
    path = store.path(h(1))
    data = bytearray(open(path, "rb").read())
    data[-10] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with caplog.at_level(logging.WARNING, logger="vlite"):
        assert read(store, h(1)) is None
    assert "damaged" in caplog.text and not os.path.exists(path)


@pytest.mark.parametrize("cut", [1, PAYLOAD, PAYLOAD + 40])
def test_truncated_file_is_a_miss(store, cut):
    store.save(h(1), payload(1))
    path = store.path(h(1))
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-cut])
    assert read(store, h(1)) is None and not os.path.exists(path)


def test_wrong_size_hash_or_model_is_a_miss(tmp_path, store):
    store.save(h(1), payload(1))
    assert read(store, h(1), PAYLOAD + 2) is None  # another block shape
    store.save(h(2), payload(2))
    os.makedirs(os.path.dirname(store.path(h(3))), exist_ok=True)
    os.replace(store.path(h(2)), store.path(h(3)))  # a file under another block's name
    assert read(store, h(3)) is None
    other = DiskKVStore.open(str(tmp_path), "model-b", 1 << 30)
    store.save(h(4), payload(4))
    os.makedirs(os.path.dirname(other.path(h(4))), exist_ok=True)
    os.replace(store.path(h(4)), other.path(h(4)))  # another model's file in this model's place
    assert read(other, h(4)) is None


def test_two_stores_share_one_directory(tmp_path):
    a = DiskKVStore.open(str(tmp_path), "model-a", 1 << 30)
    b = DiskKVStore.open(str(tmp_path), "model-a", 1 << 30)
    a.save(h(1), payload(1))
    assert b.contains(h(1)) and read(b, h(1)) == payload(1)
    assert not b.save(h(1), payload(1))


def test_quota_evicts_least_recently_used(tmp_path):
    file_bytes = PAYLOAD + 84
    s = DiskKVStore.open(str(tmp_path), "model-a", 4 * file_bytes)
    for i in range(4):
        s.save(h(i), payload(i))
        os.utime(s.path(h(i)), (1000 + i, 1000 + i))  # written in order 0, 1, 2, 3
    assert read(s, h(0)) == payload(0)  # a hit: 0 is now the most recently used
    s.save(h(4), payload(4))  # past the quota: down to 90% of it, oldest first (1, then 2)
    assert [s.contains(h(i)) for i in range(5)] == [True, False, False, True, True]
    assert s.scan_size() <= 4 * file_bytes


def test_unwritable_directory_disables_the_store(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="vlite"):
        assert DiskKVStore.open(str(blocker / "kv"), "model-a", 1 << 30) is None
    assert "not usable" in caplog.text and str(blocker) in caplog.text


def test_full_disk_turns_saving_off(store, monkeypatch, caplog):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="vlite"):
        assert not store.save(h(1), payload(1))
        assert not store.save(h(2), payload(2))
    assert caplog.text.count("is full") == 1 and not store.writable
    assert not [n for _, _, files in os.walk(store.root) for n in files if ".tmp." in n]


def test_a_dead_writers_temporary_file_is_removed_by_a_scan(store):
    store.save(h(1), payload(1))
    tmp = store.path(h(2)) + ".tmp.999999.1"
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    open(tmp, "wb").write(b"half a block")
    store.scan_size()
    assert os.path.exists(tmp)  # recent: maybe a live writer's
    os.utime(tmp, (1000, 1000))
    store.scan_size()
    assert not os.path.exists(tmp) and store.contains(h(1))

