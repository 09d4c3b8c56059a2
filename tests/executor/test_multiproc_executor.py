"""The `mp` executor with tensor parallelism (gloo) on tiny random models: float32 greedy output
token-identical to transformers at TP=2, packed int8 weights (C++ kernels, block-aligned column
shards) agreeing with TP=1, each rank holding about half the weights, and a worker killed mid-run
failing the engine at once with no process left behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.reference import compare_runs
from tests.models import tiny
from vlite import LLM, SamplingParams
from vlite.config import ParallelConfig
from vlite.executor import ExecutorDeadError
from vlite.worker.worker import weight_bytes


@pytest.fixture(scope="module")
def hf_model() -> Any:
    """Llama with biases (o and down biases are added once, by rank 0) and an untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return tiny.build(LlamaConfig, LlamaForCausalLM, seed=3, tie_word_embeddings=False, attention_bias=True,
                      mlp_bias=True)


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


def test_parallel_config_is_validated():
    assert ParallelConfig().backend == "uni" and ParallelConfig(tensor_parallel_size=2).backend == "mp"
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer in"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        ParallelConfig(distributed_executor_backend="threads")
    with pytest.raises(ValueError, match="data_parallel_size=2: several engine cores run behind the API server"):
        LLM(data_parallel_size=2)


def test_tp2_matches_transformers_with_half_the_weights(folder: Path, prompt_ids: list[list[int]], refs: list[Any]):
    llm, completions = tiny.run_vlite(folder, prompt_ids, tensor_parallel_size=2, block_size=4)
    core = llm.llm_engine.engine_core
    try:
        assert core.model_runner is None  # the model is in the workers
        print(tiny.assert_parity(completions, refs))
        per_rank = [s["weight_bytes"] for s in core.executor.worker_stats()]
    finally:
        core.shutdown()
    one = LLM(model=str(folder), dtype="float32", kv_cache_memory_bytes=16 * 2**20)
    whole = weight_bytes(one.llm_engine.engine_core.model_runner.model)
    print(f"weights: TP=1 {whole} bytes, TP=2 ranks {per_rank}")
    # Layers and vocabulary split in half; the norms (and o/down biases on rank 0) are replicated.
    assert all(0.45 * whole < b < 0.56 * whole for b in per_rank), (whole, per_rank)


def test_tp2_packed_int8_agrees_with_tp1(tokenizer: Any, model_dir: Path, prompt_ids: list[list[int]]):
    """One KV head on two ranks (replicated), a tied vocab-parallel head, int8 blocks on the C++ kernels:
    the o/down column shards cut at block boundaries, so TP=2 differs from TP=1 by summation order only.
    The kernels quantize activations to int8 on the fly, where a summation-order difference can flip a
    rounding: logprobs then move by up to ~1e-2 (measured 0.008 here); a wrong shard moves them by O(1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny.build(LlamaConfig, LlamaForCausalLM, seed=4, num_key_value_heads=1, tie_word_embeddings=True)
    path = tiny.save_hf(model, tokenizer, model_dir / "kv1")
    runs = {}
    for tp in (1, 2):
        llm, runs[tp] = tiny.run_vlite(path, prompt_ids, quantization="int8", tensor_parallel_size=tp)
        llm.llm_engine.engine_core.shutdown()
    assert [compare_runs(a, b) for a, b in zip(runs[1], runs[2])] == [tiny.MAX_NEW] * len(prompt_ids)
    gaps = [abs(a.logprobs[i][t].logprob - b.logprobs[i][t].logprob)
            for a, b in zip(runs[1], runs[2]) for i in range(tiny.MAX_NEW) for t in a.logprobs[i]]
    assert max(gaps) < 0.03, max(gaps)


def test_worker_killed_mid_run_fails_the_engine_at_once(folder: Path, prompt_ids: list[list[int]]):
    llm = LLM(model=str(folder), dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=16 * 2**20)
    executor = llm.llm_engine.engine_core.executor
    pids = [p.pid for p in executor.procs]
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(1.0)
        killed_at.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    with pytest.raises(ExecutorDeadError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
        llm.generate([{"prompt_token_ids": p} for p in prompt_ids[:2]], params, use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 1.0
    assert _pids_alive(pids) == []  # rank 0 (blocked in a collective) was stopped too
    with pytest.raises(ExecutorDeadError):
        executor.check_health()


def test_tp2_speculative_decoding_matches_transformers(folder: Path, prompt_ids: list[list[int]], refs: list[Any]):
    """n-gram drafts verified at TP=2: rank 0's accepted tokens (a varying number per request) reach the
    other rank, and greedy output stays token-identical to transformers."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "draft_policy": "always"}  # drafts beside requests without: the adaptive policy may skip a batch
    llm, completions = tiny.run_vlite(folder, prompt_ids, tensor_parallel_size=2, speculative_config=spec)
    try:
        print(tiny.assert_parity(completions, refs))
        stats = llm.llm_engine.engine_core.scheduler.spec_decoding_stats
        print(f"drafts: {stats.num_draft_tokens} tokens, {stats.num_accepted_tokens} accepted")
        assert stats.num_accepted_tokens > 0  # some steps took several tokens per request
    finally:
        llm.llm_engine.engine_core.shutdown()
