"""The batched LoRA update against a per-row reference loop: several slots, rows without an adapter,
ranks zero-padded, fused projections by output slices."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlite.lora.layout import LoRASlice
from vlite.lora.ops import LoRAKernelMeta, add_lora_linear


def reference(out: torch.Tensor, x: torch.Tensor, mapping: list[int], a: torch.Tensor, b: torch.Tensor
              ) -> torch.Tensor:
    expected = out.clone()
    for t, slot in enumerate(mapping):
        if slot >= 0:
            expected[t] += (x[t] @ a[slot].T) @ b[slot].T
    return expected


def padded_weights(ranks: list[int], max_rank: int, k: int, n: int, gen: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked A [S, max_rank, K] and B [S, N, max_rank], slot s of rank ranks[s] (zeros beyond)."""
    a, b = torch.zeros(len(ranks), max_rank, k), torch.zeros(len(ranks), n, max_rank)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, k, generator=gen)
        b[s, :, :r] = torch.randn(n, r, generator=gen)
    return a, b


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_matches_per_row_loop(data: st.DataObject) -> None:
    num_slots = data.draw(st.integers(1, 4))
    max_rank = data.draw(st.integers(1, 8))
    ranks = data.draw(st.lists(st.integers(1, max_rank), min_size=num_slots, max_size=num_slots))
    k, n = data.draw(st.integers(1, 24)), data.draw(st.integers(1, 24))
    mapping = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=0, max_size=20))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    a, b = padded_weights(ranks, max_rank, k, n, gen)
    x, out = torch.randn(len(mapping), k, generator=gen), torch.randn(len(mapping), n, generator=gen)
    expected = reference(out, x, mapping, a, b)
    meta = LoRAKernelMeta.make(torch.tensor(mapping, dtype=torch.long))
    result = add_lora_linear(out, x, meta, a, b)
    assert result is out  # in place
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert set(meta.active_lora_ids) == {s for s in mapping if s >= 0}


def test_rows_without_adapter_untouched_and_contiguous_rows_sliced() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = padded_weights([2, 4, 3], 4, 8, 6, gen)
    mapping = [2, 2, -1, 0, -1, 2, 1, 1]
    meta = LoRAKernelMeta.make(torch.tensor(mapping))
    assert meta.active_lora_ids == (0, 1, 2)
    assert meta.token_indices[0] == slice(3, 4) and meta.token_indices[1] == slice(6, 8)
    assert meta.token_indices[2].tolist() == [0, 1, 5]
    x, out = torch.randn(8, 8, generator=gen), torch.randn(8, 6, generator=gen)
    before = out.clone()
    add_lora_linear(out, x, meta, a, b)
    assert torch.equal(out[[2, 4]], before[[2, 4]])
    torch.testing.assert_close(out, reference(before, x, mapping, a, b))
    no_lora = LoRAKernelMeta.make(torch.full((8,), -1))
    assert not no_lora.has_lora
    assert torch.equal(add_lora_linear(before.clone(), x, no_lora, a, b), before)


def test_output_slices_equal_the_block_diagonal_product() -> None:
    """A fused qkv-like projection: modules of 5, 3 and 3 rows, rank blocks of 4; B zero off its blocks."""
    gen = torch.Generator().manual_seed(1)
    slices = (LoRASlice(0, 5, 0, 4), LoRASlice(5, 8, 4, 8), LoRASlice(8, 11, 8, 12))
    a = torch.randn(3, 12, 7, generator=gen)
    b = torch.zeros(3, 11, 12)
    for o0, o1, r0, r1 in slices:
        b[:, o0:o1, r0:r1] = torch.randn(3, o1 - o0, r1 - r0, generator=gen)
    b[1, 5:8, 4:8] = 0  # slot 1 leaves the middle module alone
    mapping = [1, 0, -1, 2, 1, 0]
    x, out = torch.randn(6, 7, generator=gen), torch.randn(6, 11, generator=gen)
    expected = reference(out, x, mapping, a, b)
    add_lora_linear(out, x, LoRAKernelMeta.make(torch.tensor(mapping)), a, b, slices)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
