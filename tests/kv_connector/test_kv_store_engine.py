"""The KV store across engine instances on the default model (float32): a second engine on the same
directory loads the prompt's blocks instead of computing them and generates the same tokens as an engine
without the store; damaged files are recomputed, never read as K/V."""

from __future__ import annotations

import glob
import os

import pytest

from vlite import LLM
from vlite.core.kv_cache_utils import compute_block_hashes
from vlite.sampling_params import SamplingParams

PROMPT = [(37 * i + 11) % 2000 + 100 for i in range(200)]  # 12 full blocks of 16, 8 tokens after them
ENGINE = dict(dtype="float32", max_num_batched_tokens=128, kv_cache_memory_bytes=64 * 2**20)
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run(llm: LLM) -> tuple[list[int], int]:
    out = llm.generate({"prompt_token_ids": PROMPT}, PARAMS, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def with_store(path: str) -> LLM:
    return LLM(kv_offload_dir=path, kv_offload_size=0.5, **ENGINE)


@pytest.fixture(scope="module")
def reference() -> list[int]:
    llm = LLM(enable_prefix_caching=False, **ENGINE)
    tokens, _ = run(llm)
    llm.llm_engine.engine_core.shutdown()
    return tokens


def test_second_engine_loads_the_prefix_and_matches(tmp_path, reference):
    first = with_store(str(tmp_path))
    assert run(first) == (reference, 0)
    first.llm_engine.engine_core.shutdown()  # its pending writes reach the disk
    files = sorted(glob.glob(str(tmp_path / "*" / "*" / "*.kv")))
    assert len(files) == 12

    second = with_store(str(tmp_path))
    assert run(second) == (reference, 192)
    m = second.get_metrics()
    assert (m["external_prefix_cache_queries"], m["external_prefix_cache_hits"]) == (200, 192)
    assert m["num_free_kv_blocks"] == m["num_kv_blocks"]
    second.llm_engine.engine_core.shutdown()

    # Blocks 3 and 7 damaged (truncated; one byte altered): the three before 3 load, the rest is computed.
    paths = [second.llm_engine.engine_core.kv_connector.stores[0].path(bh)
             for bh in compute_block_hashes(PROMPT, 16, [])]  # the prompt's files, in order
    with open(paths[3], "r+b") as f:
        f.truncate(os.path.getsize(paths[3]) - 100)
    with open(paths[7], "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 1]))
    third = with_store(str(tmp_path))
    assert run(third) == (reference, 48)
    third.llm_engine.engine_core.shutdown()  # block 3, recomputed, is stored again; 7 was not read (kept)
    fourth = with_store(str(tmp_path))
    assert run(fourth) == (reference, 112)  # 7 read, found damaged, deleted, recomputed and stored again
    fourth.llm_engine.engine_core.shutdown()
    fifth = with_store(str(tmp_path))
    assert run(fifth) == (reference, 192)
    fifth.llm_engine.engine_core.shutdown()


def test_unusable_directory_warns_and_the_engine_goes_on(tmp_path, reference, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level("WARNING", logger="vlite"):
        llm = with_store(str(blocker / "kv"))
    assert "not usable" in caplog.text and llm.llm_engine.engine_core.kv_connector is None
    assert run(llm) == (reference, 0)
    llm.llm_engine.engine_core.shutdown()


def test_worker_process_saves_and_loads(tmp_path, reference):
    """The mp executor: the worker-side connector lives in the worker process."""
    llm = LLM(kv_offload_dir=str(tmp_path), distributed_executor_backend="mp", **ENGINE)
    assert run(llm) == (reference, 0)
    llm.llm_engine.engine_core.shutdown()
    llm = LLM(kv_offload_dir=str(tmp_path), distributed_executor_backend="mp", **ENGINE)
    assert run(llm) == (reference, 192)
    llm.llm_engine.engine_core.shutdown()


def test_tensor_parallel_ranks_store_their_own_heads(tmp_path):
    """Each rank saves and loads its own heads; the request waits for every rank's load."""
    first = LLM(kv_offload_dir=str(tmp_path), tensor_parallel_size=2, **ENGINE)
    tokens, cached = run(first)
    first.llm_engine.engine_core.shutdown()
    assert cached == 0 and len(glob.glob(str(tmp_path / "*-tp1of2" / "*" / "*.kv"))) == 12
    second = LLM(kv_offload_dir=str(tmp_path), tensor_parallel_size=2, **ENGINE)
    assert run(second) == (tokens, 192)
    second.llm_engine.engine_core.shutdown()
