"""InputBatch: the runner's persistent per-request state, kept in preallocated arrays.

A request gets a row when it is admitted and keeps it until it finishes or is preempted, so a
step only writes what changed (new blocks, sampled tokens) instead of rebuilding the batch.
Rows are reused lowest-first; the step's inputs are gathered from the scheduled rows.
"""

from __future__ import annotations

import heapq
from typing import Optional

import numpy as np

from vlite.sampling_params import SamplingParams


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, vocab_size: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.req_ids: list[Optional[str]] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs))

        # +1: the token sampled at max_model_len is stored before the request is stopped.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)

        # Sampling parameters as columns, so a step gathers them with one fancy index.
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: none
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Speculative decoding: decayed counts of the row's accepted and rejected drafts (DraftPolicy).
        self.spec_accepted = np.zeros(max_num_reqs, dtype=np.float64)
        self.spec_rejected = np.zeros(max_num_reqs, dtype=np.float64)
        self.spec_match_len = np.zeros(max_num_reqs, dtype=np.int64)  # of the drafts being verified
        self.sampling_params: list[Optional[SamplingParams]] = [None] * max_num_reqs
        self.seeds: dict[int, int] = {}  # row -> seed of a seeded request
        # Rarely used processors, kept sparse: row -> data.
        self.allowed_token_ids: dict[int, list[int]] = {}
        self.logit_bias: dict[int, dict[int, float]] = {}
        self.bad_words: dict[int, list[list[int]]] = {}
        self.stop_token_ids: dict[int, list[int]] = {}
        # Bumped whenever a row is added or removed: what was derived from the rows' sampling
        # parameters (the runner's SamplingMetadata) stays valid while it does not change.
        self.version = 0

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, req_id: str, token_ids: list[int], num_prompt_tokens: int, num_computed_tokens: int,
                    block_ids: list[int], params: SamplingParams) -> int:
        if not self._free_rows:
            raise RuntimeError(f"input batch is full ({self.max_num_reqs} requests)")
        row = heapq.heappop(self._free_rows)
        self.version += 1
        self.req_ids[row] = req_id
        self.req_id_to_index[req_id] = row
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(row, block_ids)

        self.sampling_params[row] = params
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k if params.top_k > 0 else 0
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        lp = params.logprobs
        self.num_logprobs[row] = -1 if lp is None else (self.vocab_size if lp == -1 else min(lp, self.vocab_size))
        self.min_tokens[row] = params.min_tokens
        self.spec_accepted[row] = self.spec_rejected[row] = 0.0
        self.spec_match_len[row] = 0
        if params.seed is not None:
            self.seeds[row] = params.seed
        if params.allowed_token_ids:
            self.allowed_token_ids[row] = list(params.allowed_token_ids)
        if params.logit_bias:
            self.logit_bias[row] = dict(params.logit_bias)
        if params._bad_words_token_ids:
            self.bad_words[row] = params._bad_words_token_ids
        if params.stop_token_ids:
            self.stop_token_ids[row] = list(params.stop_token_ids)
        return row

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove_request(self, req_id: str) -> Optional[int]:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.version += 1
        self.req_ids[row] = None
        self.sampling_params[row] = None
        for sparse in (self.seeds, self.allowed_token_ids, self.logit_bias, self.bad_words,
                       self.stop_token_ids):
            sparse.pop(row, None)
        heapq.heappush(self._free_rows, row)
        return row
