"""The checkout's kernels/ folder never stands in for PyPI's `kernels` (transformers >= 5.25 imports it)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_import_kernels_from_the_checkout_root_is_never_ours():
    # `python -c` from the repository root puts it first on sys.path, as `python -m rollout_cli...` does
    probe = "import kernels, sys; print(kernels.__file__)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True)
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:  # PyPI's package absent: an empty namespace stands in
        assert result.returncode == 0 and result.stdout.strip() == "None", result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert not Path(result.stdout.strip()).resolve().is_relative_to(REPO_ROOT / "kernels"), result.stdout


# transformers' own availability probe with PyPI's `kernels` hidden (the device's environment, where
# transformers 5.17 does not depend on it): site-packages leave sys.path after transformers is imported.
_PROBE_WITHOUT_PYPI_KERNELS = """
import importlib, sys
from transformers.utils import import_utils
sys.path[:] = [p for p in sys.path if 'site-packages' not in p and 'dist-packages' not in p]
importlib.invalidate_caches()
exists, version = import_utils._is_package_available('kernels', return_version=True)
import kernels
try:
    import kernels.decode_attention
    submodule = 'importable'
except ImportError:
    submodule = 'absent'
print(exists, version, kernels.__file__, submodule)
"""


def test_transformers_reads_the_checkout_folder_as_no_kernels_package():
    result = subprocess.run([sys.executable, "-c", _PROBE_WITHOUT_PYPI_KERNELS], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "N/A", "None", "absent"], result.stdout


def test_rollout_kernels_is_the_checkouts_folder():
    import rollout_kernels

    assert Path(rollout_kernels.__file__).resolve().parent == REPO_ROOT / "kernels"
