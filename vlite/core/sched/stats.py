"""The scheduler's counters, as vLLM's SchedulerStats / SpecDecodingStats: what the engine core reports
each step and the frontends' stat loggers and /metrics read (no scheduler needed to import them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, tokens
    prefix_cache_hits: int  # cumulative, tokens
    # A KV connector's (vLLM's external prefix cache): prompt tokens of the requests it was asked about,
    # and of those the tokens it supplied; cumulative.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    spec_decoding: Optional[SpecDecodingStats] = None  # cumulative; None without speculative decoding
    # vLLM's lora_requests_info: adapter name -> its running / waiting requests, and max_loras (0: LoRA off).
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    max_lora: int = 0


def sum_scheduler_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Several engine cores' stats as one (data parallel): counts summed, adapters' counts summed per name, KV
    usage averaged; `max_lora` is each core's configured limit (the same on all), so it is taken, not summed."""
    def merged(dicts: list[dict[str, int]]) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in dicts:
            for name, n in d.items():
                out[name] = out.get(name, 0) + n
        return out

    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats) if stats else 0.0,
        num_preemptions=sum(s.num_preemptions for s in stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        external_prefix_cache_queries=sum(s.external_prefix_cache_queries for s in stats),
        external_prefix_cache_hits=sum(s.external_prefix_cache_hits for s in stats),
        spec_decoding=_sum_spec([s.spec_decoding for s in stats if s.spec_decoding is not None]),
        running_lora_adapters=merged([s.running_lora_adapters for s in stats]),
        waiting_lora_adapters=merged([s.waiting_lora_adapters for s in stats]),
        max_lora=max((s.max_lora for s in stats), default=0))


def _sum_spec(stats: list[SpecDecodingStats]) -> Optional[SpecDecodingStats]:
    if not stats:
        return None
    out = SpecDecodingStats()
    for s in stats:
        out.num_drafts += s.num_drafts
        out.num_draft_tokens += s.num_draft_tokens
        out.num_accepted_tokens += s.num_accepted_tokens
        per_pos = out.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(s.num_accepted_tokens_per_pos) - len(per_pos)))
        for i, n in enumerate(s.num_accepted_tokens_per_pos):
            per_pos[i] += n
    return out


@dataclass
class SpecDecodingStats:
    """vLLM's spec-decode counters: drafts verified, their tokens, the accepted ones (also by position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step of a request with drafts: 1 + accepted / drafts (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
