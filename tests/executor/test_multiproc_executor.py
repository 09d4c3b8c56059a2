"""The `mp` executor with tensor parallelism (gloo) on tiny random models: float32 greedy output
token-identical to transformers at TP=2, packed int8 weights (C++ kernels, block-aligned column
shards) agreeing with TP=1, each rank holding about half the weights, and a worker killed mid-run
failing the engine at once with no process left behind. How the workers start, in a user's script run
as one: forked without a `__main__` guard, spawned where threads already run (then a script without
the guard fails at once with one line)."""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
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


# ---- how the workers start: a user's plain script, run as one ----------------------------------------

_SCRIPT = """\
import pickle, sys
from vlite import LLM, SamplingParams
{prelude}
llm = LLM({folder!r}, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens={step},
          kv_cache_memory_bytes=16 * 2**20)
params = SamplingParams(temperature=0.0, max_tokens={max_new}, ignore_eos=True, logprobs=5)
outputs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}], params, use_tqdm=False)
with open(sys.argv[1], "wb") as f:
    pickle.dump((llm.llm_engine.engine_core.executor.start_method, [o.outputs[0] for o in outputs]), f)
{epilogue}"""
# Threads before LLM(): torch's OpenMP pool (a forked worker would hang in its first parallel region).
_THREADS = "import torch\ntorch.set_num_threads(2)\n(torch.randn(2000, 2000) + 1).sum()"
_ASYNC_SCRIPT = """\
import asyncio
from vlite.engine.arg_utils import EngineArgs
from vlite.engine.async_llm import AsyncLLM

async def main():
    engine = await AsyncLLM.create(EngineArgs(model={folder!r}, dtype="float32", kv_cache_memory_bytes=16 * 2**20))
    engine.shutdown()

asyncio.run(main())
"""
_GUARD = 'if __name__ == "__main__":'
_UNGUARDED = "at module level, and its processes must be started by spawn because "


# A worker killed between steps: the next generate fails at once, no worker left (as spawned ones).
_KILL_RANK_1 = """\
import os, signal, time
from vlite.executor import ExecutorDeadError
procs = llm.llm_engine.engine_core.executor.procs
os.kill(procs[1].pid, signal.SIGKILL)
start = time.monotonic()
try:
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
except ExecutorDeadError as e:
    print(f"dead after {time.monotonic() - start:.2f} s: {e}; alive: {[p.pid for p in procs if p.is_alive()]}")
"""


def _script(folder: Path, prompt_ids: list[list[int]], prelude: str = "", guard: bool = False,
            epilogue: str = "") -> str:
    body = _SCRIPT.format(prelude=prelude, folder=str(folder), step=tiny.STEP_TOKENS, max_new=tiny.MAX_NEW,
                          prompts=prompt_ids, epilogue=epilogue)
    return f"{_GUARD}\n{textwrap.indent(body, '    ')}" if guard else body


def _run_script(text: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Any, float]:
    """Run `text` as a script (this checkout's vlite, the start method left to vlite): the process, what
    it pickled (the start method and the completions) or None, and its wall time."""
    script, out = tmp_path / "script.py", tmp_path / "out.pkl"
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.endswith("_WORKER_MULTIPROC_METHOD")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    return proc, pickle.loads(out.read_bytes()) if out.exists() else None, time.monotonic() - start


def _assert_one_line_failure(proc: subprocess.CompletedProcess, seconds: float, what: str) -> None:
    """Failed at once (the start timeout is 600 s: the spawned children stop before loading anything),
    saying why and what to do in one line, once; no bootstrap traceback, no bare exit code."""
    print(proc.stderr)
    assert proc.returncode != 0 and seconds < 60
    line = next(line for line in proc.stderr.splitlines() if _UNGUARDED in line)
    assert f"the script script.py starts {what} at module level" in line
    assert line.endswith(f"put that code under `{_GUARD}`")
    assert proc.stderr.count(_UNGUARDED) == 1
    assert "bootstrapping phase" not in proc.stderr and "exited with code" not in proc.stderr


def test_a_plain_script_without_the_main_guard_forks_its_workers(folder: Path, prompt_ids: list[list[int]],
                                                                  refs: list[Any], tmp_path: Path):
    """No thread runs before LLM(): the workers are forked (the script is not re-run), each loads its
    own shard, and the output is the spawned workers' (token-identical to transformers); a forked worker
    killed fails the next generate at once and leaves no worker behind."""
    proc, result, _ = _run_script(_script(folder, prompt_ids, epilogue=_KILL_RANK_1), tmp_path)
    assert proc.returncode == 0, proc.stderr
    method, completions = result
    assert method == "fork"
    print(tiny.assert_parity(completions, refs))
    print(proc.stdout)
    assert re.search(r"dead after 0\.\d+ s: worker rank 1 \(pid \d+\) exited with code -9; alive: \[\]",
                     proc.stdout), proc.stdout


def test_a_script_with_threads_and_no_guard_fails_at_once_with_one_line(folder: Path, prompt_ids: list[list[int]],
                                                                        tmp_path: Path):
    proc, _, seconds = _run_script(_script(folder, prompt_ids, _THREADS), tmp_path)
    _assert_one_line_failure(proc, seconds, "LLM(tensor_parallel_size=2)")
    assert "because this process has started" in proc.stderr


def test_the_same_script_with_the_guard_spawns_its_workers(folder: Path, prompt_ids: list[list[int]],
                                                           refs: list[Any], tmp_path: Path):
    proc, result, _ = _run_script(_script(folder, prompt_ids, _THREADS, guard=True), tmp_path)
    assert proc.returncode == 0, proc.stderr
    method, completions = result
    assert method == "spawn"
    print(tiny.assert_parity(completions, refs))


def test_an_async_llm_script_without_the_guard_fails_at_once_with_one_line(folder: Path, tmp_path: Path):
    """AsyncLLM's engine-core process is always spawned: the same one line."""
    proc, _, seconds = _run_script(_ASYNC_SCRIPT.format(folder=str(folder)), tmp_path)
    _assert_one_line_failure(proc, seconds, "AsyncLLM")


def test_the_start_method_follows_the_environment_and_forks_only_a_single_thread(monkeypatch, caplog):
    from vlite.executor import start_method

    monkeypatch.delenv("VLITE_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert start_method.worker_start_method() == ("spawn", "VLLM_WORKER_MULTIPROC_METHOD=spawn")
    monkeypatch.setenv("VLITE_WORKER_MULTIPROC_METHOD", "forkserver")  # VLITE_ first
    with pytest.raises(ValueError, match=r"VLITE_WORKER_MULTIPROC_METHOD must be one of \('fork', 'spawn'\)"):
        start_method.worker_start_method()
    monkeypatch.setenv("VLITE_WORKER_MULTIPROC_METHOD", "fork")
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name="user-thread")
    thread.start()
    try:
        method, why = start_method.worker_start_method()  # asked for, but unsafe: spawn, with a warning
    finally:
        release.set()
        thread.join()
    assert method == "spawn" and why.startswith("this process runs other threads (") and "user-thread" in why
    assert f"VLITE_WORKER_MULTIPROC_METHOD=fork, but {why}: the workers are started by spawn" in caplog.text
