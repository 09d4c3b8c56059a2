#!/usr/bin/env bash
# Set up the environment if needed, then run vlite on the default model.
# With no arguments: the OpenAI-compatible server on 127.0.0.1:8000 (it prints a curl example once
# ready). Otherwise the arguments go to the `vlite` CLI (e.g. `chat`, `generate "Hello"`, `bench ...`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
    set -- serve
fi
exec .venv/bin/vlite "$@"
