"""Kernel tests run compiled on a GPU, and under Triton's interpreter on the CPU (tests/conftest.py
sets TRITON_INTERPRET before any test module loads)."""

import pytest

from interpreter_dot import patch_row_invariant_dot
from mtp_fixtures import with_mtp_head


@pytest.fixture
def row_invariant_dot(monkeypatch):
    """patch_row_invariant_dot for one test."""
    patch_row_invariant_dot(monkeypatch)


@pytest.fixture(scope="module")
def module_row_invariant_dot():
    """patch_row_invariant_dot for a whole module (engine-level tests: pytest.mark.usefixtures)."""
    with pytest.MonkeyPatch.context() as patcher:
        patch_row_invariant_dot(patcher)
        yield


@pytest.fixture(scope="module")
def mtp_checkpoint(tiny_hybrid_checkpoints, tmp_path_factory) -> str:
    """The tiny Qwen3-Next checkpoint with an MTP head (mtp_fixtures.with_mtp_head)."""
    return with_mtp_head(tiny_hybrid_checkpoints["qwen3_next"], tmp_path_factory.mktemp("mtp") / "qwen3_next")
