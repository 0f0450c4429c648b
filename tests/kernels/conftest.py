"""Kernel tests run compiled on a GPU, and under Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so
it is set here, before the test modules import the kernels.
"""

import os

import pytest
import torch

from interpreter_dot import patch_row_invariant_dot

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
