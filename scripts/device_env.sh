# Sourced by the scripts/device_*.sh scripts: the environment of one device call.
# kernels/ installs as rollout_kernels; without installing, a link on PYTHONPATH gives the same name.
# torch_memory_saver travels as a wheel in .whl (docs/device-runs.md says how to fetch it), if carried.
mkdir -p /tmp/rollout_path && ln -sfn "$PWD/kernels" /tmp/rollout_path/rollout_kernels
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD:/tmp/rollout_path:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
