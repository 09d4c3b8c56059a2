"""The tiny thinking model (tests/reasoning/thinking_model.py), built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reasoning import thinking_model


@pytest.fixture(scope="session")
def thinking_model_dir(tmp_path_factory) -> Path:
    return thinking_model.build(tmp_path_factory.mktemp("thinking-model"))
