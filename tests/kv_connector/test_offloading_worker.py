"""OffloadingWorker: blocks saved from one KV cache load into other block ids of another (a restart), in the
cache dtype; a damaged file ends the run of loaded blocks there."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

from vlite.kv_connector.disk_store import DiskKVStore
from vlite.kv_connector.offloading_worker import OffloadingWorker

LAYERS, HEADS, BLOCKS, BS, D = 3, 2, 8, 4, 5


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def caches(dtype: torch.dtype, fill: bool) -> list[torch.Tensor]:
    shape = (2, HEADS, BLOCKS, BS, D)
    return [torch.randn(shape).to(dtype) if fill else torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]


def wait_loaded(worker: OffloadingWorker, req_id: str) -> int:
    deadline = time.time() + 10
    while time.time() < deadline:
        finished = worker.get_finished(idle=True).finished_recving
        if req_id in finished:
            return finished[req_id]
    raise AssertionError("the load did not finish")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_then_load_into_other_blocks(tmp_path, dtype):
    src = caches(dtype, fill=True)
    writer = OffloadingWorker(DiskKVStore.open(str(tmp_path), "m", 1 << 30))
    writer.register_kv_caches(src)
    writer.save([(h(0), 5), (h(1), 2)])
    writer.shutdown()  # writes what is pending
    dst = caches(dtype, fill=False)
    reader = OffloadingWorker(DiskKVStore.open(str(tmp_path), "m", 1 << 30))
    reader.register_kv_caches(dst)
    reader.start_load({"r": [(h(0), 1), (h(1), 6)]})
    assert wait_loaded(reader, "r") == 2
    for s, d in zip(src, dst):
        assert torch.equal(d[:, :, 1], s[:, :, 5]) and torch.equal(d[:, :, 6], s[:, :, 2])
        assert not d[:, :, [0, 2, 3, 4, 5, 7]].any()  # nothing else written
    reader.shutdown()


def test_damaged_file_ends_the_run(tmp_path):
    src = caches(torch.float32, fill=True)
    store = DiskKVStore.open(str(tmp_path), "m", 1 << 30)
    writer = OffloadingWorker(store)
    writer.register_kv_caches(src)
    writer.save([(h(0), 0), (h(1), 1), (h(2), 2)])
    writer.flush()
    with open(store.path(h(1)), "r+b") as f:
        f.seek(200)
        f.write(b"\xff\xfe")
    dst = caches(torch.float32, fill=False)
    writer.register_kv_caches(dst)  # (its threads are already running; only the tensors change)
    writer.start_load({"r": [(h(0), 3), (h(1), 4), (h(2), 5)]})
    assert wait_loaded(writer, "r") == 1
    assert torch.equal(dst[0][:, :, 3], src[0][:, :, 0]) and not dst[0][:, :, 4:].any()
    assert not store.contains(h(1)) and store.contains(h(2))
    writer.shutdown()
