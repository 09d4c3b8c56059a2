"""Fixtures shared by the per-architecture tests: one tiny tokenizer and its prompts per session."""

from __future__ import annotations

from typing import Any

import pytest

from tests.models import tiny


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return tiny.tiny_tokenizer()


@pytest.fixture(scope="session")
def prompt_ids(tokenizer: Any) -> list[list[int]]:
    return tiny.prompts(tokenizer)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    """A temporary folder per test module, and a GGUF cache inside it (not the user's ~/.cache)."""
    folder = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLITE_CACHE_DIR", str(folder / "cache"))
        yield folder
