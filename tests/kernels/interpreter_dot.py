"""A tl.dot for the interpreter whose rows do not depend on their neighbours (batch-invariance tests)."""

from __future__ import annotations

import pytest
import torch


def patch_row_invariant_dot(patcher: pytest.MonkeyPatch) -> None:
    """Batch-invariance tests under the interpreter: its tl.dot is np.matmul, and OpenBLAS rounds a
    row differently depending on where the row sits in the matrix (np.matmul(A[perm], B) !=
    np.matmul(A, B)[perm] in float32), which a GPU's MMA does not. This dot sums the K products of
    every output element in K order, the same for every row, as an MMA's fixed reduction does; so
    a bit that moves with the batch under it is the kernel's doing. No-op on a GPU."""
    if torch.cuda.is_available():
        return
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc_dtype = d.data.dtype
        lhs, rhs = a.data.astype(acc_dtype), b.data.astype(acc_dtype)
        total = np.zeros(d.data.shape, dtype=acc_dtype)
        for k in range(lhs.shape[-1]):
            total += lhs[..., :, k:k + 1] * rhs[..., k:k + 1, :]
        return interpreter.TensorHandle(total + d.data, d.dtype.scalar)

    patcher.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
