import gc

import pytest
import torch

from vlite.layers import weight_arena


@pytest.mark.skipif(not weight_arena.enabled(), reason="no MADV_HUGEPAGE on this platform")
def test_place_copies_into_aligned_memory_that_outlives_its_chunk(monkeypatch):
    monkeypatch.setattr(weight_arena, "CHUNK", 4 << 20)  # a few tensors per chunk: chunks rotate
    monkeypatch.setattr(weight_arena, "_arena", weight_arena._Arena())
    originals = [torch.randn(300, 257), torch.randint(0, 255, (1 << 20,), dtype=torch.uint8),
                 torch.randn(128, 512).to(torch.float16), torch.randn(1000, 1000)]
    placed = [weight_arena.place(t) for t in originals]
    gc.collect()
    for t, p in zip(originals, placed):
        assert p.data_ptr() != t.data_ptr() and p.data_ptr() % weight_arena.ALIGN == 0
        assert p.dtype == t.dtype and p.shape == t.shape and p.is_contiguous()
        assert torch.equal(p, t)
    # the 4 MB tensor did not fit the first chunk: a second one was mapped, the first stays alive
    assert placed[0].untyped_storage().data_ptr() != placed[3].untyped_storage().data_ptr()
    placed[1].fill_(7)
    assert torch.equal(placed[0], originals[0])


def test_small_tensors_and_disabled_arena_keep_the_tensor(monkeypatch):
    small = torch.randn(16, 16)
    assert weight_arena.place(small) is small
    monkeypatch.setenv(weight_arena.ENV_VAR, "0")
    big = torch.randn(512, 512)
    assert not weight_arena.enabled()
    assert weight_arena.place(big) is big

