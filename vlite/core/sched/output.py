"""SchedulerOutput: everything the model runner learns about a step, and nothing more.

New requests arrive in full; requests the runner already holds arrive as deltas (new block ids,
their num_computed_tokens). The runner keeps the rest in its persistent batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlite.kv_connector.base import KVConnectorMetadata, KVConnectorOutput
from vlite.lora.request import LoRARequest
from vlite.pooling_params import PoolingParams
from vlite.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    # Output tokens generated before a preemption; empty for a fresh request.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # per KV cache group
    # Tokens already in the KV cache (prefix-cache hit) when the request is (re)admitted.
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None  # a pooling request: pooled when its prompt is done
    token_type_ids: list[int] | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs under; None: the base model
    # Recurrent-state models: the request's state slot, and the prefix cache's slot its state starts from
    # (-1: from zeros).
    state_slot: int = -1
    state_restore_from: int = -1


@dataclass
class CachedRequestData:
    """Parallel lists, one entry per running request the runner already holds."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)  # per request, per KV cache group
    num_computed_tokens: list[int] = field(default_factory=list)
    # The request's block count before new_block_ids: fewer than the runner holds when blocks that
    # only rejected draft tokens occupied were freed (speculative decoding).
    num_blocks_before: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]  # admitted (or resumed after preemption) this step
    scheduled_cached_reqs: CachedRequestData  # running requests scheduled again
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int  # sum of the above
    finished_req_ids: set[str]  # finished or aborted since the last step: drop from the batch
    preempted_req_ids: set[str]  # preempted this step: drop from the batch, they return as new
    # req_id -> True when this step reaches the end of the request's known tokens, i.e. the
    # runner must sample a token for it (False for a chunk in the middle of a prompt).
    sample_req_ids: set[str] = field(default_factory=set)
    # Requests with max_tokens 0 whose prompt this step completes: nothing is sampled for them (only their
    # prompt logprobs are wanted, or, for a pooling request, its pooled output); update_from_output finishes
    # them ("length"; a pooling request "stop").
    prompt_done_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: req_id -> the draft tokens scheduled after its next token (verified this step).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Thinking budgets: req_id -> the token its last logits row must yield (the next token of its reasoning
    # block's end tag; the row after its drafts, which stop short of it). See utils.forced_tokens.
    forced_token_ids: dict[str, int] = field(default_factory=dict)
    # Leading KV blocks that every running request shares (cascade attention computes their attention
    # once for the batch); see KVCacheManager.get_num_common_prefix_blocks.
    num_common_prefix_blocks: int = 0
    # Recurrent-state models: (slot, cache slot) copies after the forward, saving states at block boundaries.
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # With a KV connector: the blocks its workers load (in the background) and save (after the forward).
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Per sampled request: its new token ids and, if requested, logprobs (plain lists)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # req_id -> (token ids [num_tokens][k+1], logprobs [num_tokens][k+1], sampled ranks [num_tokens]);
    # column 0 is the sampled token, the rest the top-k.
    logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[int]]] = field(default_factory=dict)
    # req_id -> the same shape for prompt positions computed this step (first prompt token has none).
    prompt_logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[int]]] = field(default_factory=dict)
    # Speculative decoding: req_id -> draft tokens proposed for the next step (absent: none).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Pooling: req_id -> the pooled output (float32 values) of each pooling request whose prompt this step
    # completed.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # With a KV connector: the loads its worker finished since the last step.
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: tuple[list[list[int]], list[list[float]], list[int]] | None = None
    new_prompt_logprobs: tuple[list[list[int]], list[list[float]], list[int]] | None = None
    num_cached_tokens: int = 0
    # Wall time the request was first scheduled; sent with its first output (queue-time metric).
    first_scheduled_time: float | None = None
    # With finish_reason "error": why the engine failed this request (it failed alone).
    error: str | None = None
    # The error is the request's own fault (e.g. a grammar that does not compile): a 400, not a 500.
    bad_request: bool = False
    # A pooling request's output (it finishes with it).
    pooling_output: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
