"""Building the KV connector of an engine (KVTransferConfig) and the model identity its store is keyed by."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import TYPE_CHECKING, Optional

from vlite.kv_connector.base import KVConnectorRole
from vlite.kv_connector.disk_store import DiskKVStore
from vlite.kv_connector.offloading_connector import OffloadingConnector

if TYPE_CHECKING:
    from vlite.config import LoadedEngineConfig

logger = logging.getLogger("vlite")


def _files_identity(path: str) -> list[tuple[str, int, int]]:
    """(path, size, mtime) of the model file, or of each file of a model folder: another file, or the same
    path rewritten, is another model."""
    if os.path.isfile(path):
        st = os.stat(path)
        return [(os.path.abspath(path), st.st_size, st.st_mtime_ns)]
    out = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.is_file():
            st = entry.stat()
            out.append((os.path.abspath(entry.path), st.st_size, st.st_mtime_ns))
    return out


def model_id(loaded: LoadedEngineConfig) -> str:
    """A digest of everything the K/V of a block depend on besides its tokens: the model's files, its
    architecture (shapes, rope, max_model_len), the dtype, block size, weight quantization and device.
    Tensor-parallel ranks add their own suffix (store_model_id)."""
    resolved = loaded.resolved
    source = str(resolved.path / resolved.gguf_file) if resolved.gguf_file is not None else str(resolved.path)
    parts = (_files_identity(source), repr(loaded.arch), str(loaded.torch_dtype),
             loaded.config.cache_config.block_size, repr(loaded.quantization), loaded.device)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def store_model_id(base_id: str, rank: int, world_size: int) -> str:
    """The store directory of one tensor-parallel rank's heads."""
    return f"{base_id}-tp{rank}of{world_size}"


def unsupported_reason(loaded: LoadedEngineConfig) -> Optional[str]:
    """Why this engine cannot use a KV store, or None."""
    cfg = loaded.config
    if not loaded.arch.is_causal:
        return "the model keeps no KV cache"
    if not cfg.cache_config.enable_prefix_caching:
        return "prefix caching is off"
    if loaded.arch.kv_sliding_window is not None:
        return "the model frees KV blocks behind its sliding window"
    if len(loaded.kv_group_windows) > 1:
        return "the model's sliding and full layers keep their KV blocks apart (KV cache groups)"
    if loaded.arch.linear_layers:
        return "the model's linear-attention layers keep a recurrent state, which the store does not hold"
    return None


def create_kv_connector(loaded: LoadedEngineConfig, role: KVConnectorRole,
                        rank: int = 0) -> Optional[OffloadingConnector]:
    """The engine's connector for `role`, or None: no kv_transfer_config, or a store that cannot be used here
    (a warning says why; the engine runs without it)."""
    transfer = loaded.config.kv_transfer_config
    if transfer is None or loaded.kv_model_id is None:
        return None
    reason = unsupported_reason(loaded)
    if reason is not None:
        if role == KVConnectorRole.SCHEDULER:
            logger.warning("vlite: --kv-offload-dir is ignored: %s", reason)
        return None
    world_size = loaded.config.parallel_config.tensor_parallel_size
    ranks = range(world_size) if role == KVConnectorRole.SCHEDULER else [rank]
    stores = [DiskKVStore.open(transfer.offload_dir, store_model_id(loaded.kv_model_id, r, world_size),
                               transfer.offload_size_bytes) for r in ranks]
    if any(store is None for store in stores):
        return None
    if role == KVConnectorRole.SCHEDULER:
        logger.info("vlite: KV blocks stored in %s (model %s, quota %.1f GiB)", transfer.offload_dir,
                    loaded.kv_model_id, transfer.offload_size_bytes / 2**30)
    return OffloadingConnector(role, [s for s in stores if s is not None], loaded.config.cache_config.block_size)
