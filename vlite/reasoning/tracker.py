"""The engine's token-level view of one request's reasoning: whether its output is inside the thinking block.

The scheduler feeds it each token the request keeps (`accept`); structured outputs constrain only the
answer, so a grammar takes the tokens for which `accept` says "content", and masks nothing while the
block is open. A thinking budget (SamplingParams.thinking_token_budget) reads `forced_token`: once the block
holds that many tokens, the end tag is forced, token by token (the scheduler sends it to the sampler).
Tags of several tokens are followed as token sequences: a tokenizer that spells a tag differently in
context is not recognised (Qwen3's and R1's tags are single tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from vlite.reasoning.abs_reasoning_parsers import CONTENT, PENDING, REASONING, ReasoningParser


@dataclass
class ReasoningTracker:
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    implicit_start: bool
    phase: str = PENDING  # REASONING, PENDING (the output may open a block) or CONTENT
    num_reasoning_tokens: int = 0  # tokens inside the block so far (its tags included)
    num_thinking_tokens: int = 0  # tokens after the start tag (the end tag's, as they come, included)
    _recent: list[int] = field(default_factory=list)

    @classmethod
    def for_prompt(cls, parser_cls: type[ReasoningParser], tokenizer: Any,
                   prompt_token_ids: Sequence[int], output_token_ids: Sequence[int] = ()) -> ReasoningTracker:
        """The tracker of a request whose prompt is `prompt_token_ids` (the phase read off its end, as the
        server and LLM.chat read it), advanced over any output it already has."""
        start, end = parser_cls.tag_token_ids(tokenizer)
        tracker = cls(tuple(start), tuple(end), parser_cls.implicit_start,
                      parser_cls.prompt_phase_of_ids(tokenizer, prompt_token_ids))
        for token_id in output_token_ids:
            tracker.accept(token_id)
        return tracker

    @property
    def in_reasoning(self) -> bool:
        return self.phase == REASONING

    def pending_token(self) -> Optional[int]:
        """The token that, while the output has not yet chosen (PENDING), opens the block: a grammar on the
        answer allows it besides its own tokens."""
        return self.start_ids[0] if self.phase == PENDING and self.start_ids else None

    def accept(self, token_id: int) -> bool:
        """Advance over one output token; True when it is part of the answer."""
        if self.phase == PENDING:
            if self.start_ids and token_id == self.start_ids[0]:
                self.phase = REASONING
                self.num_reasoning_tokens += 1
                return False
            self.phase = REASONING if self.implicit_start else CONTENT
        if self.phase == CONTENT:
            return True
        self.num_reasoning_tokens += 1
        self.num_thinking_tokens += 1
        n = len(self.end_ids)
        if n:
            self._recent.append(token_id)
            del self._recent[:-n]
            if tuple(self._recent) == self.end_ids:
                self.phase = CONTENT
        return False

    def drafts_in_reasoning(self, drafts: list[int]) -> list[int]:
        """The leading draft tokens (speculative decoding) that stay inside the block: none while PENDING,
        and none from the one that would close it (a grammar masks the tokens after it from the next step)."""
        if self.phase != REASONING:
            return [] if self.phase == PENDING else drafts
        probe = self._probe()
        for i, token_id in enumerate(drafts):
            probe.accept(token_id)
            if probe.phase != REASONING:
                return drafts[:i]
        return drafts

    # ---- thinking budget ---------------------------------------------------------------------------

    def forced_token(self, budget: int, drafts: Sequence[int] = ()) -> Optional[int]:
        """The token a thinking budget of `budget` tokens forces next (after `drafts`, if any), else None.

        Once the block holds `budget` tokens after its start, the end tag's next token: the thinking is then
        at most `budget` tokens (fewer when the budget ran out inside an end tag the model had begun, whose
        first tokens count). A budget of 0 closes a block the output starts in (R1's implicit one too) at once.
        """
        if drafts:
            probe = self._probe()
            for token_id in drafts:
                probe.accept(token_id)
            return probe.forced_token(budget)
        if not self.end_ids or self.num_thinking_tokens < budget:
            return None
        if self.phase == REASONING or (self.phase == PENDING and self.implicit_start):
            return self.end_ids[self._end_prefix_len()]
        return None

    def drafts_within_budget(self, drafts: list[int], budget: int) -> list[int]:
        """The leading drafts a budget leaves: none from the first position whose token the budget forces (the
        step verifying them forces that position's logits row, which is the last one of the request)."""
        if self.phase == CONTENT:
            return drafts
        probe = self._probe()
        for i, token_id in enumerate(drafts):
            if probe.forced_token(budget) is not None:
                return drafts[:i]
            probe.accept(token_id)
        return drafts

    def _probe(self) -> ReasoningTracker:
        """A copy to advance over tokens not (yet) kept."""
        return ReasoningTracker(self.start_ids, self.end_ids, self.implicit_start, self.phase,
                                self.num_reasoning_tokens, self.num_thinking_tokens, list(self._recent))

    def _end_prefix_len(self) -> int:
        """How many of the end tag's first tokens the block's last tokens are (the tag is being written)."""
        recent, end = self._recent, self.end_ids
        for k in range(min(len(recent), len(end) - 1), 0, -1):
            if tuple(recent[-k:]) == end[:k]:
                return k
        return 0
