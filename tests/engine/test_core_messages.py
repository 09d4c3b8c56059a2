"""What crosses between the API process and the engine-core process survives msgpack: a pooling request (whose
sampling parameters the engine core checks again as it decodes them) and the EngineReady facts the API process
validates pooling requests with."""

from __future__ import annotations

from vlite.engine.core_messages import (EngineCoreOutputs, EngineCoreRequestType, EngineReady, decode_outputs,
                                        decode_request, encode)
from vlite.engine.input_processor import EngineCoreRequest, InputProcessor
from vlite.pooling.config import DenseLayer, PoolerConfig
from vlite.pooling_params import PoolingParams


def test_pooling_request_and_engine_ready_round_trip():
    config = PoolerConfig(task="embed", pooling_type="MEAN", dense=(DenseLayer("2_Dense", 8, 4),),
                          prompts={"query": "query: "}, is_matryoshka=True, matryoshka_dimensions=(2, 4))
    processor = InputProcessor(None, max_model_len=16, vocab_size=100, kv_capacity_tokens=64, eos_token_ids=(2,))
    processor.pooler_config, processor.hidden_size = config, 8
    _, request = processor.process_pooling_inputs("r0", {"prompt_token_ids": [5, 6, 7], "token_type_ids": [0, 0, 1]},
                                                  PoolingParams(dimensions=2))
    back = decode_request(EngineCoreRequestType.ADD, encode(request))
    assert back == request and back.pooling_params == PoolingParams(dimensions=2, task="embed")
    ready = EngineReady(16, 100, 64, 4, [2], "m", 1, runner="pooling", pooler_config=config, hidden_size=8,
                        max_prompt_tokens=16)
    assert decode_outputs(encode(EngineCoreOutputs(ready=ready))).ready == ready


def test_a_request_the_engine_core_cannot_read_fails_alone():
    """An ADD whose parameters fail the engine core's own checks (or that is not a request at all) fails that
    request, or is dropped; the busy loop goes on and reads the next one."""
    import msgspec

    from vlite.engine.core_proc import EngineCoreProc
    from vlite.sampling_params import SamplingParams

    class Core:
        def __init__(self):
            self.added = []

        def add_request(self, request):
            self.added.append(request.request_id)

    good = EngineCoreRequest("ok", [5, 6], SamplingParams(max_tokens=2), (2,), 0.0)
    raw = msgspec.msgpack.decode(encode(EngineCoreRequest("bad", [5, 6], SamplingParams(), (2,), 0.0)))
    raw["sampling_params"]["temperature"] = -1.0  # valid where it was made, not where it is read
    proc = EngineCoreProc.__new__(EngineCoreProc)
    proc.engine_core, sent = Core(), []
    proc._send = sent.append
    proc._handle(EngineCoreRequestType.ADD, msgspec.msgpack.encode(raw))
    proc._handle(EngineCoreRequestType.ADD, b"\xc1 not msgpack")
    proc._handle(EngineCoreRequestType.ABORT, msgspec.msgpack.encode({"not": "a list"}))
    proc._handle(EngineCoreRequestType.ADD, encode(good))
    assert [o.failed_requests for o in sent] == [{"bad": sent[0].failed_requests["bad"]}]
    assert "temperature" in sent[0].failed_requests["bad"]
    assert proc.engine_core.added == ["ok"]
