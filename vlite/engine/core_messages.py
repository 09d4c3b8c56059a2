"""Typed messages between the API process and the engine-core process (msgpack via msgspec).

API -> core: one frame naming the request type, one frame of payload.
core -> API: one EngineCoreOutputs per step (or per batch of handled inputs when idle).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec

from vlite.core.sched.output import EngineCoreOutput
from vlite.core.sched.stats import SchedulerStats
from vlite.engine.input_processor import EngineCoreRequest
from vlite.pooling.config import PoolerConfig


class EngineCoreRequestType(bytes, enum.Enum):
    ADD = b"\x00"  # payload: EngineCoreRequest
    ABORT = b"\x01"  # payload: list[str]
    UTILITY = b"\x02"  # payload: UtilityCall
    SHUTDOWN = b"\x03"  # payload: empty


@dataclass
class UtilityCall:
    call_id: int
    method: str  # a name in EngineCoreProc.UTILITY_METHODS
    args: list[Any] = field(default_factory=list)


@dataclass
class EngineReady:
    """Facts the API process needs, found by the engine core while loading."""

    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int
    num_kv_blocks: int
    eos_token_ids: list[int]
    model_name: str
    pid: int
    # What the API process checks pooling requests against (no torch there): the runner ("generate" or
    # "pooling"), a pooling model's pipeline and hidden size, and the longest prompt a step takes where a
    # prompt runs in one step (encoders; None where prompts are chunked).
    runner: str = "generate"
    pooler_config: Optional[PoolerConfig] = None
    hidden_size: int = 0
    max_prompt_tokens: Optional[int] = None


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: Optional[SchedulerStats] = None
    utility_call_id: Optional[int] = None
    utility_result: Any = None
    # The utility call raised: its message; `utility_bad_request` where it was the caller's error (a ValueError,
    # e.g. an adapter folder that is no LoRA adapter), raised as a ValueError again in the API process.
    utility_error: Optional[str] = None
    utility_bad_request: bool = False
    ready: Optional[EngineReady] = None
    # A fatal error in the engine core: every in-flight request fails with it.
    engine_error: Optional[str] = None
    # Requests that failed alone (e.g. an exception while processing them): id -> message.
    failed_requests: dict[str, str] = field(default_factory=dict)


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
_abort_decoder = msgspec.msgpack.Decoder(list[str])
_utility_decoder = msgspec.msgpack.Decoder(UtilityCall)


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode_request(kind: EngineCoreRequestType, payload: bytes) -> Any:
    if kind == EngineCoreRequestType.ADD:
        return _request_decoder.decode(payload)
    if kind == EngineCoreRequestType.ABORT:
        return _abort_decoder.decode(payload)
    if kind == EngineCoreRequestType.UTILITY:
        return _utility_decoder.decode(payload)
    return None


def request_id_of(payload: bytes) -> Optional[str]:
    """The request id in an ADD payload that does not decode as an EngineCoreRequest (its parameters fail the
    engine core's checks), so that request alone can fail; None where the payload holds none."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) else None


def decode_outputs(payload: bytes) -> EngineCoreOutputs:
    return _outputs_decoder.decode(payload)
