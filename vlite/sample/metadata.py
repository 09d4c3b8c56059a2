from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional

import numpy as np
import torch


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of the requests sampled in one step, as batched tensors.

    A field is None when no row in the batch uses it, so the sampler skips that stage entirely.
    """

    temperature: Optional[torch.Tensor]  # [B] float32; None when all rows are greedy
    all_greedy: bool
    all_random: bool
    top_p: Optional[torch.Tensor]  # [B] float32
    top_k: Optional[torch.Tensor]  # [B] int64, vocab size where disabled
    min_p: Optional[torch.Tensor]  # [B] float32
    generators: dict[int, torch.Generator]  # row -> generator of a seeded request
    max_num_logprobs: Optional[int]  # largest `logprobs` in the batch; None: no logprobs
    # Logits processors and penalties (None when no row uses them).
    presence_penalties: Optional[torch.Tensor] = None  # [B]
    frequency_penalties: Optional[torch.Tensor] = None  # [B]
    repetition_penalties: Optional[torch.Tensor] = None  # [B]
    prompt_token_ids: Optional[torch.Tensor] = None  # [B, max_prompt] padded with vocab_size
    output_token_ids: Optional[torch.Tensor] = None  # [B, max_out] padded with vocab_size
    disallowed_mask: Optional[torch.Tensor] = None  # [B, V] True = not in allowed_token_ids
    logit_bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # (rows, token ids, bias)
    min_tokens: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (rows, token ids) to suppress
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)  # row -> words
    output_token_lists: dict[int, list[int]] = field(default_factory=dict)  # row -> latest outputs
    # Thinking budgets (set per step by the runner from SchedulerOutput.forced_token_ids): (rows, token ids)
    # whose rows may yield only that token.
    forced_tokens: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def to(self, device: torch.device) -> SamplingMetadata:
        """The same metadata with its tensors on `device`; seeded rows' generators stay on the CPU,
        where the sampler draws their uniforms."""
        def move(x: object) -> object:
            if isinstance(x, torch.Tensor):
                return x.to(device, non_blocking=True)
            return tuple(move(t) for t in x) if isinstance(x, tuple) else x

        return replace(self, **{f.name: move(getattr(self, f.name)) for f in fields(self) if f.name != "generators"})

    @property
    def no_processors(self) -> bool:
        return (self.disallowed_mask is None and not self.bad_words_token_ids and self.min_tokens is None
                and self.logit_bias is None and self.forced_tokens is None)

    @property
    def no_penalties(self) -> bool:
        return self.presence_penalties is None and self.frequency_penalties is None and \
            self.repetition_penalties is None


def with_forced_tokens(md: SamplingMetadata, req_ids: list[str], num_drafts: Optional[np.ndarray],
                       forced: dict[str, int], device: torch.device) -> SamplingMetadata:
    """`md` with the step's thinking-budget tokens (SchedulerOutput.forced_token_ids) on each request's last
    logits row, the one after its drafts; a copy, since the batch caches metadata across steps."""
    if not forced:
        return md
    last_rows = range(len(req_ids)) if num_drafts is None else (np.cumsum(num_drafts + 1) - 1).tolist()
    pairs = [(row, forced[r]) for row, r in zip(last_rows, req_ids) if r in forced]
    if not pairs:
        return md
    rows, ids = zip(*pairs)
    return replace(md, forced_tokens=(torch.tensor(rows, device=device), torch.tensor(ids, device=device)))
