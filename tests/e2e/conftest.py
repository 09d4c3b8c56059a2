"""Prompts and transformers references shared by the end-to-end tests (computed once per session)."""

from __future__ import annotations

import pytest

from tests.conftest import GGUF_NAME
from tests.e2e.prompts import corpus_ids, prompts_of_lengths
from tests.e2e.reference import cached_references, hf_greedy_batch

LENGTHS = [1, 3, 12, 45, 130, 260, 420, 600]
MAX_NEW = 64


@pytest.fixture(scope="session")
def prompts(hf_tokenizer):
    """Eight prompts of very different lengths (1 to 600 tokens)."""
    return prompts_of_lengths(hf_tokenizer, LENGTHS)


@pytest.fixture(scope="session")
def references(request, model_dir, prompts):
    """transformers' greedy tokens and logprobs (kept on disk between runs: tests.e2e.reference.cached_references)."""
    return cached_references(lambda: hf_greedy_batch(request.getfixturevalue("hf_model"), prompts, MAX_NEW),
                             model_dir / GGUF_NAME, prompts, MAX_NEW)


@pytest.fixture(scope="session")
def shared_prefix_prompts(hf_tokenizer):
    """Six prompts, several sharing long prefixes (so the prefix cache has something to hit)."""
    ids = corpus_ids(hf_tokenizer)
    base = ids[2000:2300]
    tails = [ids[4000 + 97 * i:4000 + 97 * i + 7 + 13 * i] for i in range(6)]
    return [base + tails[0], base + tails[1], base[:150] + tails[2], base + tails[3], base[:40] + tails[4],
            tails[5]]


@pytest.fixture(scope="session")
def shared_prefix_references(request, model_dir, shared_prefix_prompts):
    return cached_references(lambda: hf_greedy_batch(request.getfixturevalue("hf_model"), shared_prefix_prompts, 32),
                             model_dir / GGUF_NAME, shared_prefix_prompts, 32)
