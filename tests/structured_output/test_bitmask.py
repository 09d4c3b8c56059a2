"""apply_grammar_bitmask (numpy unpack + one masked_fill_) against xgrammar's own kernel."""

from __future__ import annotations

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from vlite.structured_output.backend_xgrammar import apply_grammar_bitmask  # noqa: E402


@pytest.mark.parametrize("vocab", [49152, 151936, 1000])
def test_matches_xgrammar_kernel(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, words), dtype=torch.int32, generator=g)
    logits = torch.randn(6, vocab, generator=g)
    for rows in (None, [0, 2, 5]):
        expected, got = logits.clone(), logits.clone()
        xgr.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
        apply_grammar_bitmask(got, bitmask, rows)
        assert torch.equal(expected, got)
    full = logits.clone()
    xgr.apply_token_bitmask_inplace(full, bitmask)
    half = logits.bfloat16()
    apply_grammar_bitmask(half, bitmask, [1])  # bfloat16 logits are masked in place, in their dtype
    assert half.dtype == torch.bfloat16
    assert torch.equal(torch.isinf(half[1]), torch.isinf(full[1]))
    assert not torch.isinf(half[0]).any()
