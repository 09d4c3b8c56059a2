#!/usr/bin/env bash
# Run HERE (the CPU machine), once per session, before scripts/gpu_check.py goes to the device machine:
# downloads the wheels of vlite's dependencies that the device's image lacks into .whl/ (.gitignore'd,
# carried with `carry: [".whl"]`). The image has torch (CUDA), triton, transformers, tokenizers,
# safetensors, numpy, pytest, hypothesis; the offline engine and benchmarks need nothing else, the
# tests' GGUF writer needs gguf, and the engine-core process path msgspec and pyzmq.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .whl gguf==0.19.0 msgspec==0.19.0 pyzmq==27.1.0
ls -la .whl && du -sh .whl
