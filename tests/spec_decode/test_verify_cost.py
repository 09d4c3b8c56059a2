"""measure_verify_cost on a fake runner whose steps advance a fake clock: what it times, keeps and refuses."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vlite.spec_decode import verify_cost
from vlite.spec_decode.verify_cost import CONTEXT_BLOCKS, MEASURED_VERIFY_TOKENS, REPEATS, measure_verify_cost

BLOCK_SIZE = 4


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def perf_counter(self) -> float:
        return self.t


class FakeModel:
    """A forward of q tokens takes cost(q) seconds on `clock` and writes its K/V."""

    def __init__(self, clock: Clock, cost) -> None:
        self.clock, self.cost, self.calls = clock, cost, []

    def __call__(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        self.calls.append(len(input_ids))
        self.clock.t += self.cost(len(input_ids))
        for cache in kv_caches:  # [2, heads, blocks, block_size, head_dim] of 1 head of 1: the slot is the position
            cache.view(2, -1)[:, positions] = 1.0
        return torch.zeros(len(input_ids), 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def fake_runner(clock: Clock, cost, num_blocks: int = 64) -> SimpleNamespace:
    """What measure_verify_cost reads of a runner (VerifyTarget); the backend records the metadata asked for."""
    metadata = []
    backend = SimpleNamespace(build_metadata=lambda *args, **kw: metadata.append(kw) or kw)
    return SimpleNamespace(model=FakeModel(clock, cost), kv_caches=[torch.zeros(2, 1, num_blocks, BLOCK_SIZE, 1)],
                           attn_backend=backend, block_size=BLOCK_SIZE, attention_windows=(0,),
                           max_decode_query_len=4, vocab_size=10, metadata=metadata)


def line(q: int) -> float:
    return 1e-3 * (1 + 0.1 * (q - 1))


def test_measures_each_step_size_keeps_the_best_and_extends_the_line(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(verify_cost, "time", clock)
    runner = fake_runner(clock, line)
    cost = measure_verify_cost(runner, 20, num_blocks=64, key=("line",))
    np.testing.assert_allclose(cost, [line(q) for q in range(1, 21)])
    assert runner.model.calls == list(range(1, MEASURED_VERIFY_TOKENS + 1)) * REPEATS
    # verify steps of one request after CONTEXT_BLOCKS blocks, with the kernels' precision of one row
    assert {md["precise_rows"] for md in runner.metadata} == {1}
    assert [md["max_query_len"] for md in runner.metadata[:3]] == [1, 2, 3]
    assert not runner.kv_caches[0].any()  # the scratch blocks zeroed again
    # kept for the process's later engines of the same model: no second measurement, a prefix for fewer tokens
    again = fake_runner(clock, line)
    np.testing.assert_allclose(measure_verify_cost(again, 8, num_blocks=64, key=("line",)), cost[:8])
    assert again.model.calls == []


def test_refuses_without_room_or_with_disturbed_timings(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(verify_cost, "time", clock)
    # the context and the longest step need more blocks than the cache has
    runner = fake_runner(clock, line, num_blocks=CONTEXT_BLOCKS + 1)
    assert measure_verify_cost(runner, 8, num_blocks=CONTEXT_BLOCKS + 1, key=("small",)) is None
    assert runner.model.calls == []
    # a 1-token step slower than longer ones: the machine was busy, the default model is used, nothing kept
    busy = fake_runner(clock, lambda q: 5e-3 if q == 1 else line(q))
    assert measure_verify_cost(busy, 8, num_blocks=64, key=("busy",)) is None
    assert not any(key[0] == "busy" for key in verify_cost._verify_costs)
