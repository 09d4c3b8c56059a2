"""DiskKVStore: KV blocks as files in a directory that several processes may share.

    <root>/<model_id>/<hash[:2]>/<hash>.kv     one block: header + the block's K/V of every layer

The key is the block's prefix hash (sha256 over the parent hash, the block's token ids and extra keys such
as the LoRA adapter: stable across processes) under the model's identity (`model_id`: the model file,
dtype, block size, shapes, quantization and tensor-parallel rank), so a block is only ever read back by an
engine that computes the same K/V.

Safety with other processes and with crashes:
- a file is written under a temporary name and renamed into place (os.replace), so a reader sees a whole
  file or none;
- a reader checks the header (magic, model, hash, length) and a CRC32 of the payload: a truncated, altered
  or foreign file is a miss (and deleted), never wrong K/V;
- a file may vanish between the existence check and the read (another process evicted it): a miss.
The directory's size is kept under a quota: past it, the least recently used files (by mtime; a hit
touches its file) are deleted, whoever wrote them. Pure Python, no torch.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
import threading
import time
import zlib
from typing import Optional

logger = logging.getLogger("vlite")

_MAGIC = b"VLITEKV1"
_HEADER = struct.Struct("<8s32s32sQI")  # magic, sha256(model_id), block hash, payload bytes, crc32(payload)
SUFFIX = ".kv"
# After eviction the store is this fraction of its quota, so that eviction runs once per many writes.
_EVICT_TO = 0.9
# Writes between two scans of the directory's real size (other processes write to it too).
_RESCAN_EVERY = 256
# A temporary file older than this was left by a writer that died mid-write: deleted by the next scan.
_STALE_TMP_S = 3600.0


class DiskKVStore:
    """One model's view of a shared directory of KV block files (`open` checks it is usable)."""

    def __init__(self, root: str, model_id: str, quota_bytes: int) -> None:
        self.root = root
        self.model_id = model_id
        self.dir = os.path.join(root, model_id)
        self.quota_bytes = quota_bytes
        self._model_digest = hashlib.sha256(model_id.encode()).digest()
        self._lock = threading.Lock()
        self._size_estimate: Optional[int] = None  # bytes in the whole root, from the last scan plus our writes
        self._writes_since_scan = 0
        self.writable = True  # False after a full disk or a write error: the store serves reads only

    @classmethod
    def open(cls, root: str, model_id: str, quota_bytes: int) -> Optional[DiskKVStore]:
        """The store, or None (with a warning) when the directory cannot be created or written."""
        store = cls(root, model_id, quota_bytes)
        probe = os.path.join(store.dir, f".probe.{os.getpid()}.{threading.get_ident()}")
        try:
            os.makedirs(store.dir, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"\0" * 64)
            os.remove(probe)
        except OSError as e:
            logger.warning("vlite: KV offload directory %s is not usable (%s); running without the KV store",
                           root, e)
            return None
        return store

    def path(self, block_hash: bytes) -> str:
        name = block_hash.hex()
        return os.path.join(self.dir, name[:2], name + SUFFIX)

    def contains(self, block_hash: bytes) -> bool:
        return os.path.exists(self.path(block_hash))

    # ---- read ---------------------------------------------------------------------------------

    def load_into(self, block_hash: bytes, out: memoryview) -> bool:
        """Read the block's payload into `out` (its exact size); False if missing, or not a whole, intact
        block of this model (the file is then deleted). A hit touches the file (least recently used last)."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
                ok = len(header) == _HEADER.size and f.readinto(out) == len(out) and not f.read(1)
        except OSError:
            return False  # missing, or vanished since it was found
        if not (ok and self._header_ok(header, block_hash, out)):
            logger.warning("vlite: KV store file %s is damaged or foreign; its tokens are recomputed", path)
            self._remove(path)
            return False
        try:
            os.utime(path)
        except OSError:
            pass
        return True

    def _header_ok(self, header: bytes, block_hash: bytes, payload: memoryview) -> bool:
        magic, model, stored_hash, n, crc = _HEADER.unpack(header)
        return (magic == _MAGIC and model == self._model_digest and stored_hash == block_hash
                and n == len(payload) and zlib.crc32(payload) == crc)

    # ---- write --------------------------------------------------------------------------------

    def save(self, block_hash: bytes, payload: bytes | memoryview) -> bool:
        """Store a block unless its file exists; True if written. A full disk or a write error turns
        writing off (one warning): the engine goes on without saving."""
        if not self.writable:
            return False
        path = self.path(block_hash)
        if os.path.exists(path):
            return False
        header = _HEADER.pack(_MAGIC, self._model_digest, block_hash, len(payload), zlib.crc32(payload))
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            self._remove(tmp)
            self.writable = False
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            logger.warning("vlite: KV offload directory %s %s (%s); KV blocks are no longer saved", self.root,
                           "is full" if full else "cannot be written", e)
            return False
        self._account(_HEADER.size + len(payload))
        return True

    def _account(self, nbytes: int) -> None:
        with self._lock:
            self._writes_since_scan += 1
            if self._size_estimate is None or self._writes_since_scan >= _RESCAN_EVERY:
                self._size_estimate = self.scan_size()
                self._writes_since_scan = 0
            else:
                self._size_estimate += nbytes
            if self._size_estimate > self.quota_bytes:
                self._size_estimate = self.evict(int(self.quota_bytes * _EVICT_TO))

    # ---- quota --------------------------------------------------------------------------------

    def _files(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every block file under the root (every model's); stale temporaries go."""
        out = []
        stale = time.time() - _STALE_TMP_S
        stack = [self.root]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except OSError:
                continue
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.name.endswith(SUFFIX):
                        st = entry.stat(follow_symlinks=False)
                        out.append((st.st_mtime, st.st_size, entry.path))
                    elif ".kv.tmp." in entry.name and entry.stat(follow_symlinks=False).st_mtime < stale:
                        self._remove(entry.path)
                except OSError:
                    continue  # vanished meanwhile
        return out

    def scan_size(self) -> int:
        return sum(size for _, size, _ in self._files())

    def evict(self, target_bytes: int) -> int:
        """Delete the least recently used block files until the root holds at most `target_bytes`;
        returns what it holds then."""
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= target_bytes:
                break
            self._remove(path)
            total -= size  # deleted, by us or by another process meanwhile
        return total

    @staticmethod
    def _remove(path: str) -> bool:
        try:
            os.remove(path)
            return True
        except OSError:
            return False  # already gone (another process evicted it)
