"""Fixtures shared by the per-architecture tests: one tiny tokenizer and its prompts per session; per
module, transformers' references and the Hugging Face folder of the module's `hf_model`."""

from __future__ import annotations

from pathlib import Path
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


@pytest.fixture(scope="module")
def refs(hf_model: Any, prompt_ids: list[list[int]]) -> list[Any]:
    """transformers' greedy references for the module's tiny model."""
    return tiny.references(hf_model, prompt_ids)


@pytest.fixture(scope="module")
def folder(hf_model: Any, tokenizer: Any, model_dir: Path) -> Path:
    """The module's tiny model saved as a Hugging Face folder (a module may override, e.g. sharded)."""
    return tiny.save_hf(hf_model, tokenizer, model_dir / "hf")
