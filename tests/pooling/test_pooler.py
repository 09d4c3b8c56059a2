"""vlite.pooling.pooler against per-request reference code: MEAN / MEAN_SQRT_LEN / MAX / CLS / LAST over random
segments of a flat step, chunked prompts combined, skipped instruction tokens, Dense + Normalize, Matryoshka
truncation, classification activations, ALL."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from vlite.pooling.config import DenseLayer, PoolerConfig, PoolingType
from vlite.pooling.pooler import Pooler

H = 8


def reference(x: torch.Tensor, kind: str) -> torch.Tensor:
    """One request's rows [n, H] pooled the plain way."""
    x = x.float()
    return {PoolingType.MEAN: lambda: x.mean(0), PoolingType.MEAN_SQRT_LEN: lambda: x.sum(0) / len(x) ** 0.5,
            PoolingType.MAX: lambda: x.max(0).values, PoolingType.CLS: lambda: x[0], PoolingType.LAST: lambda: x[-1]}[kind]()


def layout(lengths: list[int], gaps: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Segments with unpooled rows between them (other requests' chunks): starts, lengths, total rows."""
    starts, row = [], 0
    for n, gap in zip(lengths, gaps):
        row += gap
        starts.append(row)
        row += n
    return torch.tensor(starts), torch.tensor(lengths), row


segments = st.lists(st.tuples(st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(segs=segments, kind=st.sampled_from([PoolingType.MEAN, PoolingType.MEAN_SQRT_LEN, PoolingType.MAX,
                                            PoolingType.CLS, PoolingType.LAST]),
       bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_pool_matches_reference(segs: list[tuple[int, int]], kind: str, bf16: bool, seed: int) -> None:
    starts, lengths, total = layout([n for n, _ in segs], [g for _, g in segs])
    hidden = torch.randn(total, H, generator=torch.Generator().manual_seed(seed))
    if bf16:
        hidden = hidden.bfloat16()
    pooled = Pooler(PoolerConfig(pooling_type=kind)).pool(hidden, starts, lengths)
    assert pooled.dtype == torch.float32
    for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        torch.testing.assert_close(pooled[i], reference(hidden[s:s + n], kind), atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 30), cut=st.data(), kind=st.sampled_from([PoolingType.MEAN, PoolingType.MAX,
                                                                  PoolingType.LAST, PoolingType.CLS]))
def test_chunks_combined_equal_whole_prompt(n: int, cut: st.DataObject, kind: str) -> None:
    """A prompt pooled chunk by chunk (reduce + combine, then finish) equals it pooled whole."""
    hidden = torch.randn(n, H)
    cuts = sorted(set(cut.draw(st.lists(st.integers(1, n - 1), max_size=3))))
    pooler = Pooler(PoolerConfig(pooling_type=kind))
    acc = None
    for lo, hi in zip([0] + cuts, cuts + [n]):
        part = pooler.reduce(hidden[lo:hi], torch.tensor([0]), torch.tensor([hi - lo]))
        acc = part if acc is None else pooler.combine(acc, part)
    whole = pooler.pool(hidden, torch.tensor([0]), torch.tensor([n]))
    torch.testing.assert_close(pooler.finish(acc, torch.tensor([n])), whole, atol=1e-5, rtol=1e-5)


def test_skip_leaves_instruction_tokens_out() -> None:
    hidden = torch.randn(10, H)
    pooler = Pooler(PoolerConfig(pooling_type=PoolingType.MEAN, include_prompt=False))
    out = pooler.pool(hidden, torch.tensor([0, 4]), torch.tensor([4, 6]), skip=torch.tensor([1, 2]))
    torch.testing.assert_close(out, torch.stack([hidden[1:4].mean(0), hidden[6:10].mean(0)]))


def test_dense_normalize_and_matryoshka(tmp_path) -> None:
    from safetensors.torch import save_file

    w, b = torch.randn(6, H), torch.randn(6)
    save_file({"linear.weight": w, "linear.bias": b}, str(tmp_path / "model.safetensors"))
    cfg = PoolerConfig(pooling_type=PoolingType.CLS, dense=(DenseLayer(str(tmp_path), H, 6, True, "tanh"),),
                       normalize=True, is_matryoshka=True)
    pooler = Pooler(cfg)
    pooled = torch.randn(3, H)
    full = torch.tanh(pooled @ w.T + b)
    torch.testing.assert_close(pooler.embed(pooled), F.normalize(full, dim=-1))
    torch.testing.assert_close(pooler.embed(pooled, normalize=False), full)
    rows = pooler.embed(pooled, dimensions=[2, None, 4])
    assert [r.shape[0] for r in rows] == [2, 6, 4]
    torch.testing.assert_close(rows[0], F.normalize(full[0, :2], dim=-1))
    cfg.check_dimensions(4, H)
    with pytest.raises(ValueError):
        cfg.check_dimensions(7, H)
    with pytest.raises(ValueError, match="matryoshka"):
        PoolerConfig().check_dimensions(4, H)


@pytest.mark.parametrize("activation", ["sigmoid", "softmax", "identity"])
def test_score_activations(activation: str) -> None:
    head = torch.nn.Linear(H, 3)
    pooler = Pooler(PoolerConfig(task="classify", pooling_type=PoolingType.CLS, num_labels=3, activation=activation),
                    classify=head)
    x = torch.randn(4, H)
    with torch.no_grad():
        logits = head(x)
        expect = {"sigmoid": logits.sigmoid(), "softmax": logits.softmax(-1), "identity": logits}[activation]
        torch.testing.assert_close(pooler.score(x), expect)
        torch.testing.assert_close(pooler.score(x, activation=False), logits)


def test_all_tokens() -> None:
    hidden = torch.randn(9, H)
    rows = Pooler(PoolerConfig(pooling_type=PoolingType.ALL, normalize=False)).tokens(
        hidden, torch.tensor([1, 5]), torch.tensor([3, 4]))
    torch.testing.assert_close(rows[0], hidden[1:4])
    torch.testing.assert_close(rows[1], hidden[5:9])
