"""InputBatch: the runner's persistent per-request state, kept in preallocated arrays.

A request gets a row when it is admitted and keeps it until it finishes or is preempted, so a
step only writes what changed (new blocks, sampled tokens) instead of rebuilding the batch.
Rows are reused lowest-first; the step's inputs are gathered from the scheduled rows, and so is
the SamplingMetadata of the rows a step samples (`make_sampling_metadata`, as vLLM's InputBatch
builds its own).
"""

from __future__ import annotations

import heapq
from typing import Optional, Sequence, Union

import numpy as np
import torch

from vlite.sample.metadata import SamplingMetadata
from vlite.sample.sampler import seeded_generator
from vlite.sampling_params import SamplingParams


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, vocab_size: int,
                 eos_token_ids: Sequence[int] = (), device: Union[str, torch.device] = "cpu",
                 num_kv_groups: int = 1) -> None:
        """`eos_token_ids`: what min_tokens suppresses besides a request's stop ids; `device`: the
        sampler's, where the SamplingMetadata goes; `num_kv_groups`: KV cache groups, a block table each."""
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.req_ids: list[Optional[str]] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs))

        # +1: the token sampled at max_model_len is stored before the request is stopped.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = [np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
                             for _ in range(num_kv_groups)]
        self.block_table = self.block_tables[0]  # the first group's (the only one of most models)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.state_slot = np.full(max_num_reqs, -1, dtype=np.int64)  # recurrent-state models: each row's slot

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
        # parameters (the SamplingMetadata) stays valid while it does not change.
        self.version = 0
        self._md_cache: Optional[tuple[tuple, SamplingMetadata, Optional[tuple]]] = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, req_id: str, token_ids: list[int], num_prompt_tokens: int, num_computed_tokens: int,
                    block_ids: Sequence[Sequence[int]], params: SamplingParams) -> int:
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

    def append_block_ids(self, row: int, block_ids: Sequence[Sequence[int]]) -> None:
        """Each group's new block ids (the same count in every group); a flat list: the only group's."""
        if block_ids and not isinstance(block_ids[0], (list, tuple)):
            block_ids = (block_ids,)
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        for table, ids in zip(self.block_tables, block_ids):
            table[row, start:start + len(ids)] = ids
        self.num_blocks[row] = start + len(block_ids[0])

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

    # ---- the step's SamplingMetadata -------------------------------------------------------

    def make_sampling_metadata(self, rows: np.ndarray, offsets: Optional[np.ndarray] = None) -> SamplingMetadata:
        """The SamplingMetadata of logits rows sampled for `rows`; reused while the same rows are
        sampled with nothing that changes per step (penalties' token lists, min_tokens, sparse processors).

        `offsets` (speculative decoding): logits row i scores the token after offsets[i] drafts of
        its request (rows[i] repeats), which count as output tokens for penalties and processors.
        """
        key = (self.version, rows.tobytes(), None if offsets is None else offsets.tobytes())
        # Metadata without a per-row field (all greedy, no processors or penalties: flags and the logprobs
        # count only) fits any number of logits rows of the same requests: verify steps of any draft count reuse it.
        cached = self._md_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        distinct = rows if offsets is None else rows[offsets == 0]  # a request's first row: offset 0
        shared_key = (self.version, distinct.tobytes())
        if cached is not None and cached[2] == shared_key:
            self._md_cache = (key, cached[1], shared_key)
            return cached[1]
        md = self._build_sampling_metadata(rows, offsets)
        per_step = (not md.no_penalties or md.min_tokens is not None or md.disallowed_mask is not None
                    or md.logit_bias is not None or md.bad_words_token_ids or (self.min_tokens[rows] > 0).any()
                    or md.generators)
        # (per_step metadata is not kept at all: penalties, processors and generators are covered there)
        per_row = md.temperature is not None or md.top_p is not None or md.top_k is not None or md.min_p is not None
        if self.device.type != "cpu":
            md = md.to(self.device)
        self._md_cache = None if per_step else (key, md, None if per_row else shared_key)
        return md

    def _build_sampling_metadata(self, rows: np.ndarray, offsets: Optional[np.ndarray] = None) -> SamplingMetadata:
        temperature = self.temperature[rows]
        greedy = temperature < 1e-5
        top_p, top_k, min_p = self.top_p[rows], self.top_k[rows], self.min_p[rows]
        num_logprobs = self.num_logprobs[rows]
        # batch row -> its logits rows (several per request verifying drafts)
        positions: dict[int, list[int]] = {}
        for i, r in enumerate(rows.tolist()):
            positions.setdefault(r, []).append(i)
        num_tokens = self.num_tokens[rows] if offsets is None else self.num_tokens[rows] + offsets

        def col(values: np.ndarray, neutral: float) -> torch.Tensor | None:
            return torch.from_numpy(values) if (values != neutral).any() else None

        md = SamplingMetadata(
            temperature=None if greedy.all() else torch.from_numpy(temperature),
            all_greedy=bool(greedy.all()),
            all_random=bool((~greedy).all()),
            top_p=col(top_p, 1.0),
            top_k=torch.from_numpy(np.where(top_k > 0, top_k, self.vocab_size)) if (top_k > 0).any() else None,
            min_p=col(min_p, 0.0),
            # A seeded request draws the uniform of output token t from a generator keyed by (seed, t):
            # its tokens then depend on nothing else, not even on how many drafts a step verified.
            generators={i: seeded_generator(seed, int(num_tokens[i] - self.num_prompt_tokens[r]))
                        for r, seed in self.seeds.items() if self.temperature[r] >= 1e-5
                        for i in positions.get(r, ())},
            max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
            presence_penalties=col(self.presence_penalty[rows], 0.0),
            frequency_penalties=col(self.frequency_penalty[rows], 0.0),
            repetition_penalties=col(self.repetition_penalty[rows], 1.0),
        )
        if not md.no_penalties:
            md.prompt_token_ids, md.output_token_ids = self._padded_token_ids(rows, num_tokens)
        self._add_sparse_processors(md, rows, positions, num_tokens)
        return md

    def _padded_token_ids(self, rows: np.ndarray, n_total: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt and output ids of the rows (outputs: the first n_total tokens), right-padded with
        vocab_size (an id that never occurs)."""
        n_prompt = self.num_prompt_tokens[rows]
        max_prompt = int(n_prompt.max())
        max_out = max(int((n_total - n_prompt).max()), 1)
        j = np.arange(max_prompt)
        prompt = np.where(j < n_prompt[:, None], self.token_ids[rows, :max_prompt], self.vocab_size)
        k = n_prompt[:, None] + np.arange(max_out)
        out = np.where(k < n_total[:, None],
                       self.token_ids[rows[:, None], np.minimum(k, self.token_ids.shape[1] - 1)], self.vocab_size)
        return torch.from_numpy(prompt), torch.from_numpy(out)

    def _add_sparse_processors(self, md: SamplingMetadata, rows: np.ndarray, positions: dict[int, list[int]],
                               num_tokens: np.ndarray) -> None:
        if any(r in positions for r in self.allowed_token_ids):
            mask = torch.zeros(len(rows), self.vocab_size, dtype=torch.bool)
            for r, ids in self.allowed_token_ids.items():
                for i in positions.get(r, ()):
                    mask[i] = True
                    mask[i, ids] = False
            md.disallowed_mask = mask
        bias_rows, bias_ids, bias_vals = [], [], []
        for r, bias in self.logit_bias.items():
            for i in positions.get(r, ()):
                bias_rows += [i] * len(bias)
                bias_ids += list(bias)
                bias_vals += list(bias.values())
        if bias_rows:
            md.logit_bias = (torch.tensor(bias_rows), torch.tensor(bias_ids), torch.tensor(bias_vals))
        min_rows, min_ids = [], []
        for r, pos in positions.items():
            if self.min_tokens[r] <= 0:
                continue
            for i in pos:
                if num_tokens[i] - self.num_prompt_tokens[r] < self.min_tokens[r]:
                    params = self.sampling_params[r]
                    ids = list(self.stop_token_ids.get(r, [])) + ([] if params and params.ignore_eos
                                                                  else self.eos_token_ids)
                    min_rows += [i] * len(ids)
                    min_ids += ids
        if min_rows:
            md.min_tokens = (torch.tensor(min_rows), torch.tensor(min_ids))
        for r, words in self.bad_words.items():
            longest = max(len(w) for w in words)
            for i in positions.get(r, ()):
                md.bad_words_token_ids[i] = words
                end = int(num_tokens[i])
                start = max(int(self.num_prompt_tokens[r]), end - longest)
                md.output_token_lists[i] = self.token_ids[r, start:end].tolist()
