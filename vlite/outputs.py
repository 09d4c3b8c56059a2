"""What users get back: RequestOutput and CompletionOutput, as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Logprob:
    """One candidate token at one position: its log-probability, its rank (1 = most likely)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per position: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[PromptLogprobs] = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
