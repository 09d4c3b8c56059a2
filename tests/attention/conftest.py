"""Triton kernels run on the GPU where there is one, else on the CPU under Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test module of
this directory imports vlite.attention.ops; an explicit TRITON_INTERPRET in the environment wins.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def triton_device() -> torch.device:
    """Where the Triton kernels under test run (skips when they cannot run at all)."""
    pytest.importorskip("triton", reason="triton is not installed (the `test` and `gpu` extras bring it)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("no GPU and TRITON_INTERPRET is not 1: Triton kernels cannot run here")
    return torch.device("cuda")
