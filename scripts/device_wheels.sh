#!/usr/bin/env bash
# Fill .whl with what a device call needs beyond the device image (torch, triton, transformers, typer are
# there): torch_memory_saver, and the daemon's web stack (uvicorn, fastapi and their needs) at the versions
# of this checkout's .venv, for the parts that start `rollout serve` (recipe06). The device has no package
# index; scripts/device_env.sh installs every wheel in .whl into /tmp/site. Pass carry [".whl"] to the call.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
fetch() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"; }
fetch torch_memory_saver
# pinned to the venv's versions: pip --no-deps resolves nothing, and one pin (pydantic -> pydantic_core) is exact
web=$("$PY" -m pip freeze | grep -iE '^(uvicorn|fastapi|starlette|pydantic|pydantic[-_]core|annotated[-_]types|annotated[-_]doc|typing[-_]inspection|typing[-_]extensions|anyio|sniffio|h11|httpx|httpcore|idna|certifi|opentelemetry-api)==')
fetch $web
ls .whl
