"""The `ray` executor: TP=2 ranks as Ray actors placed by a placement group, float32 greedy output
token-identical to transformers on a local Ray (ray.init(num_cpus=2)) and on a two-node cluster on
this machine (a head and a second node, one CPU each), where the ranks land on different nodes; an
actor killed mid-run fails the engine at once."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.models import tiny

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return tiny.build(LlamaConfig, LlamaForCausalLM, seed=5, tie_word_embeddings=False, attention_bias=True)


@pytest.fixture
def ray_env(monkeypatch: pytest.MonkeyPatch):
    """Ray's worker processes import vlite from this checkout (every node needs vlite importable)."""
    monkeypatch.setenv("PYTHONPATH", ROOT)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    yield
    ray.shutdown()


def _run(folder: Path, prompt_ids: list[list[int]]) -> tuple[Any, list[Any], list[str]]:
    llm, completions = tiny.run_vlite(folder, prompt_ids, tensor_parallel_size=2, distributed_executor_backend="ray")
    executor = llm.llm_engine.engine_core.executor
    nodes = list(executor.node_ids)
    return llm, completions, nodes


def test_two_node_cluster_places_one_rank_per_node(ray_env, folder: Path, prompt_ids: list[list[int]],
                                                    refs: list[Any]):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)  # a second raylet with its own resources: another node
        ray.init(address=cluster.address)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        llm, completions, nodes = _run(folder, prompt_ids)
        try:
            assert len(set(nodes)) == 2, nodes  # one CPU per node: the placement group spans both
            print(tiny.assert_parity(completions, refs), nodes)
        finally:
            llm.llm_engine.engine_core.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_local_ray_matches_transformers_then_fails_at_once_when_an_actor_dies(
        ray_env, folder: Path, prompt_ids: list[list[int]], refs: list[Any]):
    import os
    import signal
    import threading
    import time

    from vlite import SamplingParams
    from vlite.executor import ExecutorDeadError

    ray.init(address="local", num_cpus=2, include_dashboard=False)  # a new local Ray, not one found running
    llm, completions, nodes = _run(folder, prompt_ids)
    print(tiny.assert_parity(completions, refs), nodes)
    executor = llm.llm_engine.engine_core.executor
    pid = executor.worker_info[1]["pid"]
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(1.0)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    with pytest.raises(ExecutorDeadError, match="Ray worker rank 1 died"):
        llm.generate([{"prompt_token_ids": p} for p in prompt_ids[:2]],
                     SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True), use_tqdm=False)
    print(f"failed {time.monotonic() - killed_at[0]:.2f}s after the kill")
    assert time.monotonic() - killed_at[0] < 2.0


def test_missing_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch):
    from vlite.executor.ray_executor import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'vlite\[ray\]'"):
        import_ray()
