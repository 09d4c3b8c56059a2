"""The tiny harmony model (tests/harmony/harmony_model.py), built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harmony import harmony_model


@pytest.fixture(scope="session")
def harmony_model_dir(tmp_path_factory) -> Path:
    return harmony_model.build(tmp_path_factory.mktemp("harmony-model"))
