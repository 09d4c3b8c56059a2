"""Prometheus metrics with vLLM's names, so existing dashboards work unchanged."""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vlite.core.sched.stats import SchedulerStats, SpecDecodingStats
from vlite.engine.output_processor import IterationStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class PrometheusStatLogger:
    """Called with each batch of engine outputs; owns its own registry (no global state)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.num_running = Gauge("vllm:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.num_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels,
                                 registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%).", labels,
                              registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels,
                                   registry=r)
        # A KV connector's (--kv-offload-dir) hits, beside the engine's own prefix cache (vLLM's names).
        self.external_prefix_queries = Counter("vllm:external_prefix_cache_queries",
                                               "Prompt tokens looked up in the external KV store.", labels, registry=r)
        self.external_prefix_hits = Counter("vllm:external_prefix_cache_hits",
                                            "Prompt tokens found in the external KV store.", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemptions.", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", labels,
                                         registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests.", labels + ["finished_reason"],
                                       registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time spent waiting before first scheduled.",
                                    labels, buckets=_E2E_BUCKETS, registry=r)
        # Speculative decoding (vLLM's names): drafts verified, their tokens, those accepted (also by position).
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Draft sequences verified.", labels, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", labels,
                                         registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels,
                                     registry=r)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft.",
                                             labels + ["position"], registry=r)
        # vLLM's vllm:lora_requests_info, created with the first stats of an engine with LoRA on (max_lora > 0).
        self.lora_info: Optional[Gauge] = None
        self.model_name = model_name
        self._last: Optional[SchedulerStats] = None
        for m in (self.num_running, self.num_waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
                  self.external_prefix_queries, self.external_prefix_hits, self.preemptions, self.prompt_tokens,
                  self.generation_tokens):
            m.labels(model_name)

    def __call__(self, stats: Optional[SchedulerStats], it: Optional[IterationStats]) -> None:
        name = self.model_name
        if stats is not None:
            self.num_running.labels(name).set(stats.num_running_reqs)
            self.num_waiting.labels(name).set(stats.num_waiting_reqs)
            self.kv_usage.labels(name).set(stats.kv_cache_usage)
            last = self._last
            self.prefix_queries.labels(name).inc(stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0))
            self.prefix_hits.labels(name).inc(stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0))
            self.external_prefix_queries.labels(name).inc(
                stats.external_prefix_cache_queries - (last.external_prefix_cache_queries if last else 0))
            self.external_prefix_hits.labels(name).inc(
                stats.external_prefix_cache_hits - (last.external_prefix_cache_hits if last else 0))
            self.preemptions.labels(name).inc(stats.num_preemptions - (last.num_preemptions if last else 0))
            if stats.spec_decoding is not None:
                self._log_spec_decoding(stats.spec_decoding, last.spec_decoding if last else None)
            if stats.max_lora > 0:
                self._log_lora(stats)
            self._last = stats
        if it is not None:
            self.generation_tokens.labels(name).inc(it.num_generation_tokens)
            self.prompt_tokens.labels(name).inc(it.num_prompt_tokens)
            for t in it.time_to_first_tokens:
                self.ttft.labels(name).observe(t)
            for t in it.inter_token_latencies:
                self.itl.labels(name).observe(t)
            for f in it.finished_requests:
                self.request_success.labels(name, f.finish_reason).inc()
                self.e2e.labels(name).observe(f.e2e_latency)
                if f.queue_time is not None:
                    self.queue_time.labels(name).observe(f.queue_time)

    def _log_lora(self, stats: SchedulerStats) -> None:
        """vLLM's LoRA info gauge: the adapters with running and with waiting requests (comma-separated names) and
        max_lora as labels, the time of the update as its value; dashboards read the latest series."""
        if self.lora_info is None:
            self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                   ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                   registry=self.registry)
        self.lora_info.labels(str(stats.max_lora), ",".join(stats.waiting_lora_adapters),
                              ",".join(stats.running_lora_adapters)).set_to_current_time()

    def _log_spec_decoding(self, spec: SpecDecodingStats, last: Optional[SpecDecodingStats]) -> None:
        name = self.model_name
        self.spec_drafts.labels(name).inc(spec.num_drafts - (last.num_drafts if last else 0))
        self.spec_draft_tokens.labels(name).inc(spec.num_draft_tokens - (last.num_draft_tokens if last else 0))
        self.spec_accepted.labels(name).inc(spec.num_accepted_tokens - (last.num_accepted_tokens if last else 0))
        before = last.num_accepted_tokens_per_pos if last else []
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            self.spec_accepted_per_pos.labels(name, str(pos)).inc(n - (before[pos] if pos < len(before) else 0))
