"""Every kernel test runs on each ISA build this CPU can run (an AVX-512 machine runs the avx512,
avx2 and portable builds): none is skipped just because CI has the better CPU."""

from __future__ import annotations

import pytest

from vlite import _custom_ops

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in _custom_ops.supported_isas(),
                                                   reason=f"this CPU cannot run the {isa} build"))
        for isa in _custom_ops.ISAS]


@pytest.fixture(params=ISAS)
def ops(request):
    """The C++ kernels module of one ISA build."""
    module = _custom_ops.load(request.param)
    assert module is not None, "the C++ kernels failed to build"
    assert module.isa().startswith(request.param)
    return module
