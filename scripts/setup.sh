#!/usr/bin/env bash
# Create .venv and install rollout with its test dependencies.
# torch is pinned to 2.13.0 because that CPU wheel is on local disk on our
# CPU machines; on a GPU machine install your CUDA build of torch first
# (any torch >= 2.5 is accepted) and this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[test]"
