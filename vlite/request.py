"""The engine core's view of one request: its tokens, progress and lifecycle state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from vlite.lora.request import LoRARequest
    from vlite.pooling_params import PoolingParams
    from vlite.reasoning.tracker import ReasoningTracker
    from vlite.sampling_params import SamplingParams
    from vlite.structured_output.request import StructuredOutputRequest


class FinishReason(str, enum.Enum):
    """Why a request ended, spelled as OpenAI's `finish_reason`."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.IntEnum):
    """Ordered lifecycle: every state after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # its structured-output grammar is being compiled
    # Its prefix's KV blocks are being loaded from outside the engine (a KV connector); it holds their blocks
    # and waits in skipped_waiting without holding up the others.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> Optional[FinishReason]:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False)
class Request:
    """A request as the scheduler tracks it.

    `num_computed_tokens` is the one counter that drives scheduling: the scheduler hands out
    tokens until it catches up with `num_tokens` (prompt + output so far). There is no
    prefill/decode flag; a request is "prefilling" while num_computed_tokens < num_prompt_tokens.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache the first time this request was scheduled.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    stop_reason: int | str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of all_token_ids, filled lazily by the KV cache manager.
    block_hashes: list[bytes] = field(default_factory=list)
    # Speculative decoding: draft tokens proposed after the last step, verified with the next token in the
    # next one. Not part of all_token_ids (nor of any prefix-cache hash) until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    # Set by the structured-output manager for a request with sampling_params.structured_outputs.
    structured_output_request: Optional[StructuredOutputRequest] = None
    # With a reasoning parser (--reasoning-parser): whether the output is inside the thinking block. Set for a
    # request with structured outputs (the grammar takes the answer's tokens only); a thinking budget reads it.
    reasoning: Optional[ReasoningTracker] = None
    # A pooling request (embedding, score, class): its sampling_params ask for no token (max_tokens 0); it
    # ends once its prompt is computed and pooled ("pooling finished").
    pooling_params: Optional[PoolingParams] = None
    # Cross-encoders: each prompt token's segment (0: the query, 1: the document); None: all 0.
    token_type_ids: Optional[list[int]] = None
    # The LoRA adapter the request runs under; None: the base model.
    lora_request: Optional[LoRARequest] = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        # A pooling request ends once its prompt is computed: no token (its sampling_params stay valid ones).
        self.max_tokens = 0 if self.pooling_params is not None else self.sampling_params.max_tokens
        if self.sampling_params.structured_outputs is not None:
            self.status = RequestStatus.WAITING_FOR_FSM

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> Optional[FinishReason]:
        return RequestStatus.get_finished_reason(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
