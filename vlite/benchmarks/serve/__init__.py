"""`vlite bench serve`: online serving benchmark against a running `vlite serve` (or any OpenAI-compatible server).

The output follows `vllm bench serve`. Requests (random token-id prompts as in `vlite bench throughput`,
or `--dataset-path`) are sent to `/v1/completions` (or `/v1/chat/completions`) with `stream: true`,
`stream_options: {"include_usage": true}`, `max_tokens` = the request's output length and `ignore_eos:
true`, so every request generates exactly its output length. Arrivals: `--request-rate R` requests/s
as a Poisson process (exponential gaps, seeded; `--burstiness` other than 1 gives gamma-distributed
gaps of the same mean), or all at once (`inf`, the default); `--max-concurrency N` caps the requests
in flight (the rest wait, and their clock starts when they are sent).

Per request, timed on the client from the moment it is sent:

    TTFT     time to the first content chunk (a choice with text, or its finish_reason)
    ITL      the gaps between consecutive content chunks (one token each, unless the server merges)
    TPOT     (E2E - TTFT) / (output tokens - 1): mean time per output token after the first
    E2E      time until the stream ended (`data: [DONE]`)
    output tokens   `usage.completion_tokens` of the final usage chunk (else: the content chunks)

A request fails on a non-200 answer, an error event in the stream, a stream that ends before
`data: [DONE]`, or a transport error; failed requests count in no metric but "Failed requests".
Throughputs are over the benchmark duration: from the first request's scheduled send to the last
request's end.

Random prompts need the served model's vocabulary; the tokenizer is loaded (fast, cached, no model
weights) when it is known: `--tokenizer`, else the served model when it is the bundled default model
or a local path. Otherwise the ids are drawn from `FALLBACK_TOKEN_IDS` (1000..29999), a range that holds
ordinary (non-special) tokens in common vocabularies (SmolLM2, Llama, Qwen, Mistral, GPT-2).

Layout: `workload.py` (arrival times, the prompts' vocabulary, request bodies), `client.py` (one streamed
request timed, many sent on a schedule), `report.py` (summary, report, plot), `command.py` (the flags
and the run).
"""
