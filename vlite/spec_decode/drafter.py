"""Drafter: speculative decoding's part of the runner's step, after sampling (the verify part is the
runner's forward and the rejection sampler).

    ModelRunner.sample_tokens: the step's tokens appended to the batch, then Drafter.propose:
      1. each sampled request's acceptance record learns what its drafts of this step got (DraftPolicy.update)
      2. NgramProposer drafts for every sampled request at once
      3. DraftPolicy caps each request's drafts at what pays, the step at `max_verify_tokens`
    -> ModelRunnerOutput.spec_token_ids, which the next SchedulerOutput schedules
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from vlite.config import SpeculativeConfig
from vlite.spec_decode.draft_policy import DraftPolicy
from vlite.spec_decode.ngram_proposer import NgramProposer
from vlite.utils import group_starts

if TYPE_CHECKING:
    from vlite.worker.input_batch import InputBatch


class Drafter:
    def __init__(self, config: SpeculativeConfig, verify_cost: Callable[[int], Optional[np.ndarray]]) -> None:
        """`verify_cost(max_tokens)`: DraftPolicy's cost model, cost[q - 1] for steps of q = 1..max_tokens
        verify tokens (spec_decode.verify_cost), or None for the default one."""
        self.config = config
        self.proposer = NgramProposer(config)
        k = config.num_speculative_tokens
        max_tokens = max(k + 1, config.max_verify_tokens)
        self.policy = DraftPolicy(k, verify_cost(max_tokens), max_tokens=max_tokens)

    def propose(self, batch: InputBatch, req_ids: list[str], rows: np.ndarray, num_drafts: np.ndarray,
                num_accepted: np.ndarray) -> dict[str, list[int]]:
        """The next step's drafts of the sampled requests `req_ids` (batch rows `rows`), after this step
        verified `num_drafts` of theirs and accepted `num_accepted` (zeros for a step without drafts)."""
        batch.spec_accepted[rows], batch.spec_rejected[rows] = self.policy.update(
            batch.spec_accepted[rows], batch.spec_rejected[rows], num_drafts, num_accepted, batch.spec_match_len[rows])
        return self._propose(batch, req_ids, rows)

    def _propose(self, batch: InputBatch, req_ids: list[str], rows: np.ndarray) -> dict[str, list[int]]:
        """Each request drafts what pays at the acceptance expected of its drafts (DraftPolicy: from
        their matched context and its own record; verify tokens cost ~0.15 of a step each on a CPU).
        Drafts go only to a step where every request sampled has some, so a request without a match
        never waits for others' drafts; several requests draft only when the whole step is predicted
        to pay (DraftPolicy.batch_pays); and within `max_verify_tokens` (sampled requests plus
        drafts): past it a CPU step is compute-bound and drafts cost what they save, so a busy batch
        gets none."""
        config = self.config
        budget = config.max_verify_tokens - len(rows)
        if budget <= 0 or (config.disable_by_batch_size is not None
                           and batch.num_reqs > config.disable_by_batch_size):
            return {}
        adaptive = config.draft_policy == "adaptive"
        cap = np.full(len(rows), min(config.num_speculative_tokens, budget))
        num_tokens = batch.num_tokens[rows]
        # only the rows' tokens so far are copied (a whole row is max_model_len long)
        drafts, num_drafts, match_len = self.proposer.propose(batch.token_ids[rows, :int(num_tokens.max())],
                                                              num_tokens, cap)
        if adaptive:
            acc, rej = batch.spec_accepted[rows], batch.spec_rejected[rows]
            num_drafts = np.minimum(num_drafts, self.policy.num_drafts(acc, rej, match_len))
        if not num_drafts.any() or (adaptive and not num_drafts.all()):
            return {}
        # Keep the budget: cut the drafts that would pass it.
        num_drafts = np.clip(budget - group_starts(num_drafts), 0, num_drafts)
        if adaptive and not self.policy.batch_pays(acc, rej, match_len, num_drafts):
            return {}
        batch.spec_match_len[rows] = match_len
        return {req_ids[i]: drafts[i, :n].tolist() for i, n in enumerate(num_drafts.tolist()) if n}
