"""What `vlite bench serve` sends: the arrival schedule, the random prompts' vocabulary, the request bodies."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Optional, Sequence

from vlite.benchmarks.datasets import BenchRequest, allowed_token_ids, tokenizer_special_ids
from vlite.benchmarks.serve.client import error_message

FALLBACK_TOKEN_IDS = range(1000, 30000)


# --------------------------------------------------------------------------------------------------
# Arrivals
# --------------------------------------------------------------------------------------------------

def arrival_times(num_requests: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Send times (seconds from the start) of `num_requests` requests arriving at `rate` per second.

    The first request goes at 0; the gaps are independent gamma(shape=burstiness, mean=1/rate) draws
    (exponential, i.e. a Poisson process, at burstiness 1). `rate=inf`: all at 0. Seeded.
    """
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"request rate must be positive, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += rng.expovariate(rate) if burstiness == 1.0 else rng.gammavariate(burstiness, theta)
        times.append(t)
    return times


# --------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------

def tokenizer_model_for(model_id: str, root: Optional[str], tokenizer_arg: Optional[str]
                        ) -> tuple[bool, Optional[str]]:
    """Which model's tokenizer gives the random prompts' vocabulary: (found, `resolve_model` argument).

    `--tokenizer` wins; else the served model when its id or root names the bundled default model,
    or when its id is a local path. (False, None) means: no tokenizer, use FALLBACK_TOKEN_IDS.
    """
    if tokenizer_arg:
        return True, tokenizer_arg
    from vlite.model_loader.resolve import DEFAULT_GGUF_NAME

    default_names = {DEFAULT_GGUF_NAME, Path(DEFAULT_GGUF_NAME).stem}
    if model_id in default_names or root in default_names:
        return True, None
    for candidate in (model_id, root):
        if candidate and Path(candidate).expanduser().exists():
            return True, candidate
    return False, None


def load_vocabulary(model_id: str, root: Optional[str], tokenizer_arg: Optional[str]
                    ) -> tuple[Optional[Any], Sequence[int], str]:
    """(tokenizer or None, the token ids random prompts draw from, a description of where they came from)."""
    found, name = tokenizer_model_for(model_id, root, tokenizer_arg)
    if found:
        from vlite.model_loader import load_tokenizer, resolve_model

        resolved = resolve_model(name)
        tokenizer = load_tokenizer(resolved)
        pool = allowed_token_ids(len(tokenizer), tokenizer_special_ids(tokenizer))
        return tokenizer, pool, f"the tokenizer of {resolved.name} ({len(tokenizer)} tokens)"
    return None, FALLBACK_TOKEN_IDS, (f"token ids {FALLBACK_TOKEN_IDS.start}..{FALLBACK_TOKEN_IDS.stop - 1} (the "
                                      "served model's tokenizer is unknown; --tokenizer sets it)")


async def prompt_texts(client: Any, base_url: str, headers: dict[str, str], model: str,
                       requests: Sequence[BenchRequest], tokenizer: Any) -> list[str]:
    """The prompts as text (for chat): decoded by the tokenizer, else by the server's /detokenize."""
    if tokenizer is not None:
        return [tokenizer.decode(r.prompt_token_ids) for r in requests]
    texts = []
    for r in requests:
        response = await client.post(f"{base_url}/detokenize", headers=headers,
                                     json={"model": model, "tokens": r.prompt_token_ids})
        if response.status_code != 200:
            raise ValueError(f"{base_url}/detokenize answered {response.status_code}: "
                             f"{error_message(response.text)}; give --tokenizer to decode the prompts here")
        texts.append(response.json()["prompt"])
    return texts


def build_payload(model: str, request: BenchRequest, chat: bool, prompt_text: Optional[str] = None,
                  ignore_eos: bool = True, temperature: Optional[float] = None) -> dict[str, Any]:
    """The body of one streamed request: the prompt's token ids (completions) or its text as a user message (chat)."""
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        if prompt_text is None:
            raise ValueError("chat requests need the prompt as text")
        payload["messages"] = [{"role": "user", "content": prompt_text}]
        payload["max_completion_tokens"] = request.output_len
    else:
        payload["prompt"] = list(request.prompt_token_ids)
        payload["max_tokens"] = request.output_len
    if ignore_eos:
        payload["ignore_eos"] = True
    if temperature is not None:
        payload["temperature"] = temperature
    return payload
