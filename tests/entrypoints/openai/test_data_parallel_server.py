"""`vlite serve --data-parallel-size 2`: two engine cores behind one API server. 32 concurrent
requests are spread over both (each core does work) and every answer is the model's greedy
completion; /metrics sums the cores; killing one core's process fails only the requests it was
serving, and the server keeps answering on the other."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

from benchmarks.soak import engine_core_pids
from tests.entrypoints.openai.conftest import start_server, stop_server
from vlite import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(32)]
MAX_TOKENS = 6


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, started: asyncio.Event) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                started.set()
    errors = [e for e in events if "error" in e]
    finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    return {"error": errors[0]["error"]["message"] if errors else None, "finish": finish}


def test_two_cores_share_the_load_and_fail_alone(tmp_path_factory):
    expected = [o.outputs[0].text for o in LLM(dtype="float32").generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)]
    srv = start_server(tmp_path_factory, "--data-parallel-size", "2", "--max-num-seqs", "8")
    try:
        cores = engine_core_pids(srv.proc.pid)
        assert len(cores) == 2, cores
        before = [_cpu_seconds(p) for p in cores]

        async def burst() -> list[str]:
            async with httpx.AsyncClient(base_url=srv.url, headers=srv.headers, timeout=300) as client:
                async def one(prompt: str) -> str:
                    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                                   "temperature": 0})
                    assert r.status_code == 200, r.text
                    return r.json()["choices"][0]["text"]
                return await asyncio.gather(*(one(p) for p in PROMPTS))

        assert asyncio.run(burst()) == expected
        work = [_cpu_seconds(p) - b for p, b in zip(cores, before)]
        print(f"engine-core CPU seconds for the burst: {work}")
        assert all(w > 0.3 for w in work), work  # both cores served (an idle core polls, ~0 CPU)
        metrics = srv.metrics()
        assert metrics["vllm:request_success_total"] >= len(PROMPTS), metrics  # summed over the cores

        async def kill_one() -> list[dict]:
            async with httpx.AsyncClient(base_url=srv.url, headers=srv.headers, timeout=300) as client:
                started = [asyncio.Event() for _ in range(8)]
                tasks = [asyncio.create_task(_stream(client, PROMPTS[i], 100, started[i])) for i in range(8)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
                os.kill(cores[1], signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), 240)

        results = asyncio.run(kill_one())
        failed = [r for r in results if r["error"]]
        done = [r for r in results if r["finish"] == ["length"] and not r["error"]]
        print(f"after killing core 1: {len(done)} finished, {len(failed)} failed: {failed[:1]}")
        assert failed and done and len(failed) + len(done) == 8, results
        assert all("engine core 1" in r["error"] for r in failed)
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200  # core 0 still serves
        r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=60,
                       json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[0]
        assert stop_server(srv) == 0
    finally:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)
