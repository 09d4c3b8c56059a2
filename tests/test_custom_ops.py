"""The kernel loader: a build killed midway (torch's lock file left behind) never makes a later
start wait on it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vlite import _custom_ops


def test_a_killed_builds_lock_does_not_block_the_next_load(tmp_path):
    if _custom_ops.load() is None:
        pytest.skip("no C++ kernels on this machine")
    from torch.utils.cpp_extension import _get_build_directory

    isa = _custom_ops.requested_isa()
    name = _custom_ops._build_name(isa, _custom_ops._compile_flags(isa))
    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    open(lock, "w").close()  # what a build killed between torch's lock and its removal leaves
    try:
        # A fresh process (this one has the module already): before, it polled the lock for 600 s.
        code = "from vlite import _custom_ops; assert _custom_ops.build(_custom_ops.requested_isa()) is not None"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        assert not os.path.exists(lock)
    finally:
        if os.path.exists(lock):
            os.remove(lock)
