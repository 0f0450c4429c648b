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
    except importlib.metadata.PackageNotFoundError:  # PyPI's package absent: the name is simply missing
        assert result.returncode != 0 and "No module named 'kernels'" in result.stderr, result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert not Path(result.stdout.strip()).resolve().is_relative_to(REPO_ROOT / "kernels"), result.stdout


def test_rollout_kernels_is_the_checkouts_folder():
    import rollout_kernels

    assert Path(rollout_kernels.__file__).resolve().parent == REPO_ROOT / "kernels"
