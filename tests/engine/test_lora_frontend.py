"""LoRA between the user and the engine core, without a model: the engine args' LoRAConfig, the input
processor's checks, the adapter crossing to the engine-core process, a bad adapter failing its request alone as
a bad request, adapter utility calls (their errors raised in the API process, data parallel combined), and the
LoRA stats summed over engine cores."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

import pytest

from vlite.config import LoRAConfig
from vlite.core.sched.stats import SchedulerStats, SpecDecodingStats, sum_scheduler_stats
from vlite.engine.arg_utils import EngineArgs
from vlite.engine.core_client import AsyncMPClient, DPAsyncMPClient
from vlite.engine.core_messages import (EngineCoreOutputs, EngineCoreRequestType, UtilityCall, decode_outputs,
                                        decode_request, encode)
from vlite.engine.core_proc import EngineCoreProc
from vlite.engine.input_processor import EngineCoreRequest, InputProcessor
from vlite.lora.peft_adapter import LoRAAdapterError
from vlite.lora.request import LoRARequest
from vlite.sampling_params import SamplingParams

L1 = LoRARequest("one", 1, "/adapters/one")


def test_engine_args_lora_config():
    assert EngineArgs()._lora_config(None) is None
    assert EngineArgs(enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=4)._lora_config(None) == \
        LoRAConfig(max_loras=3, max_lora_rank=8, max_cpu_loras=4)
    with pytest.raises(ValueError, match="max_loras must be a positive integer"):
        EngineArgs(enable_lora=True, max_loras=0)._lora_config(None)
    from vlite.config import SpeculativeConfig

    ngram = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2})
    assert EngineArgs(enable_lora=True)._lora_config(ngram) == LoRAConfig()  # model-free drafts: allowed


def processor() -> InputProcessor:
    return InputProcessor(None, max_model_len=16, vocab_size=100, kv_capacity_tokens=64, eos_token_ids=(2,))


def test_input_processor_lora_checks():
    p = processor()
    with pytest.raises(ValueError, match=r"lora_request 'one' given.*--enable-lora"):
        p.process_inputs("r", [5, 6], SamplingParams(), lora_request=L1)
    p.enable_lora = True
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest, got dict"):
        p.process_inputs("r", [5, 6], SamplingParams(), lora_request={"lora_name": "one"})
    _, req = p.process_inputs("r", [5, 6], SamplingParams(), lora_request=L1)
    assert req.lora_request is L1
    _, base = p.process_inputs("r", [5, 6], SamplingParams())
    assert base.lora_request is None


def test_adapter_crosses_to_the_engine_core():
    req = EngineCoreRequest("r", [5, 6], SamplingParams(), (2,), 0.0, lora_request=L1)
    back = decode_request(EngineCoreRequestType.ADD, encode(req))
    assert back.lora_request == L1 and (back.lora_request.lora_int_id, back.lora_request.lora_path) == (1, L1.lora_path)


class FakeCore:
    def __init__(self) -> None:
        self.added: list[str] = []
        self.loras: dict[int, LoRARequest] = {}

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.lora_request is not None:
            self.add_lora(request.lora_request)
        self.added.append(request.request_id)

    def add_lora(self, lora: LoRARequest) -> bool:
        if "missing" in lora.lora_path:
            raise LoRAAdapterError(lora.lora_path, "no adapter_config.json")
        new = lora.lora_int_id not in self.loras
        self.loras[lora.lora_int_id] = lora
        return new

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.loras.pop(lora_int_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.loras)

    def pin_lora(self, lora_int_id: int) -> bool:
        if lora_int_id not in self.loras:
            raise ValueError(f"LoRA adapter id {lora_int_id} is not loaded")
        return True


def make_proc() -> tuple[EngineCoreProc, list[EngineCoreOutputs]]:
    proc = EngineCoreProc.__new__(EngineCoreProc)
    proc.engine_core, sent = FakeCore(), []
    proc._send = lambda msg: sent.append(decode_outputs(encode(msg)))
    return proc, sent


def test_bad_adapter_fails_its_request_alone_as_a_bad_request():
    proc, sent = make_proc()
    bad = LoRARequest("bad", 2, "/adapters/missing")
    for rid, lora in (("a", L1), ("b", bad), ("c", None)):
        proc._handle(EngineCoreRequestType.ADD, encode(EngineCoreRequest(rid, [5], SamplingParams(), (2,), 0.0,
                                                                         lora_request=lora)))
    assert proc.engine_core.added == ["a", "c"]
    assert len(sent) == 1 and not sent[0].failed_requests
    (out,) = sent[0].outputs
    assert out.request_id == "b" and out.finished and out.bad_request
    assert "/adapters/missing: no adapter_config.json" in out.error


def _utility(proc: EngineCoreProc, call_id: int, method: str, *args) -> None:
    proc._handle(EngineCoreRequestType.UTILITY, encode(UtilityCall(call_id, method, list(args))))


def test_lora_utility_calls():
    proc, sent = make_proc()
    for name in ("add_lora", "remove_lora", "list_loras", "pin_lora"):
        assert name in EngineCoreProc.UTILITY_METHODS
    _utility(proc, 0, "add_lora", L1)
    _utility(proc, 1, "add_lora", LoRARequest("two", 2, "/adapters/two"))
    _utility(proc, 2, "list_loras")
    _utility(proc, 3, "pin_lora", 1)
    _utility(proc, 4, "add_lora", LoRARequest("bad", 3, "/adapters/missing"))
    _utility(proc, 5, "pin_lora", 9)
    _utility(proc, 6, "remove_lora", 2)
    by_id = {m.utility_call_id: m for m in sent}
    assert [by_id[i].utility_result for i in (0, 1, 2, 3, 6)] == [True, True, [1, 2], True, True]
    assert by_id[4].utility_bad_request and "no adapter_config.json" in by_id[4].utility_error
    assert by_id[5].utility_bad_request and "id 9 is not loaded" in by_id[5].utility_error
    assert proc.engine_core.list_loras() == {1}


class FakeSocket:
    def __init__(self, messages: list[EngineCoreOutputs]) -> None:
        self.messages = [encode(m) for m in messages]

    async def poll(self, timeout: int) -> bool:
        return bool(self.messages)

    async def recv(self) -> bytes:
        return self.messages.pop(0)


def test_utility_errors_are_raised_in_the_api_process():
    async def go():
        client = AsyncMPClient.__new__(AsyncMPClient)
        loop = asyncio.get_running_loop()
        futures = {i: loop.create_future() for i in range(3)}
        client._pending_utility, client.ready = dict(futures), None
        client.output_socket = FakeSocket([
            EngineCoreOutputs(utility_call_id=0, utility_result=[1, 2]),
            EngineCoreOutputs(utility_call_id=1, utility_error="LoRA adapter /x: bad", utility_bad_request=True),
            EngineCoreOutputs(utility_call_id=2, utility_error="boom")])
        for _ in range(3):
            await client.get_output(0)
        assert futures[0].result() == [1, 2]
        with pytest.raises(ValueError, match="LoRA adapter /x: bad"):
            futures[1].result()
        with pytest.raises(RuntimeError, match="boom"):
            futures[2].result()

    asyncio.run(go())


class FakeClient:
    def __init__(self, result) -> None:
        self.result = result

    async def call_utility(self, method: str, *args):
        return self.result


def _dp(results: list) -> DPAsyncMPClient:
    dp = DPAsyncMPClient.__new__(DPAsyncMPClient)
    dp.clients, dp._alive = [FakeClient(r) for r in results], [True] * len(results)
    return dp


def test_data_parallel_combines_lora_answers():
    assert asyncio.run(_dp([[1, 3], [2, 3]]).call_utility("list_loras")) == [1, 2, 3]
    assert asyncio.run(_dp([True, True]).call_utility("add_lora", L1)) is True
    assert asyncio.run(_dp([True, False]).call_utility("remove_lora", 1)) is False
    a = SchedulerStats(1, 2, 0.5, 1, 10, 5, running_lora_adapters={"one": 1}, waiting_lora_adapters={"two": 2},
                       max_lora=2, spec_decoding=SpecDecodingStats(1, 2, 1, [1, 0]))
    b = SchedulerStats(2, 0, 0.25, 0, 4, 1, running_lora_adapters={"one": 2, "two": 1}, max_lora=2)
    stats = asyncio.run(_dp([asdict(a), asdict(b)]).call_utility("get_stats"))
    assert stats["running_lora_adapters"] == {"one": 3, "two": 1} and stats["waiting_lora_adapters"] == {"two": 2}
    assert stats["max_lora"] == 2 and stats["num_running_reqs"] == 3 and stats["kv_cache_usage"] == 0.375
    assert stats["spec_decoding"]["num_drafts"] == 1


def test_summed_stats():
    a = SchedulerStats(1, 0, 0.2, 0, 0, 0, running_lora_adapters={"x": 1}, max_lora=4)
    b = SchedulerStats(0, 3, 0.4, 2, 0, 0, waiting_lora_adapters={"x": 3})
    total = sum_scheduler_stats([a, b])
    assert total.running_lora_adapters == {"x": 1} and total.waiting_lora_adapters == {"x": 3}
    assert total.max_lora == 4 and total.num_preemptions == 2 and total.kv_cache_usage == pytest.approx(0.3)
    assert decode_outputs(encode(EngineCoreOutputs(stats=total))).stats == total
