#!/usr/bin/env bash
# Set up the environment if needed, then run vlite on the default model.
# With no arguments: an interactive chat. Otherwise the arguments go to the `vlite` CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
    set -- chat
fi
exec .venv/bin/vlite "$@"
