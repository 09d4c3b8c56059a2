"""KVTransferConfig: --kv-offload-dir / --kv-offload-size validated at the boundary, errors naming the field."""

from __future__ import annotations

import os

import pytest

from vlite.config import KVTransferConfig


def test_from_user() -> None:
    assert KVTransferConfig.from_user(None, 16.0) is None
    cfg = KVTransferConfig.from_user("~/kv", 0.5)
    assert cfg is not None and cfg.offload_dir == os.path.expanduser("~/kv") and cfg.offload_size_bytes == 2**29


@pytest.mark.parametrize("size", [0, -1.0, float("nan"), "8", True])
def test_bad_size_names_the_field(size) -> None:
    with pytest.raises(ValueError, match="kv_offload_size"):
        KVTransferConfig.from_user("/tmp/kv", size)


def test_empty_dir_names_the_field() -> None:
    with pytest.raises(ValueError, match="kv_offload_dir"):
        KVTransferConfig("  ")
