"""Weights holding NaN or inf (a trainer that diverged, a broken export) make every logprob NaN, and a
run would write them without complaint; they are refused where they load instead.

The check is one float32 sum per tensor (NaN and inf survive a sum; no mask the size of the tensor is
allocated) and one host sync per device. It runs where the tensors already are: cheap on a GPU
(bandwidth-bound, milliseconds for an 8B model), about 1 s per GB on a few CPU cores, so a caller
decides whether host tensors are worth it (engine/weights/weight_updates.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

# float8 weights have no inf and their NaN is one bit pattern a quantizer never writes; their float32
# scales are checked
CHECKED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def nonfinite_names(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the (name, tensor) pairs whose floating tensor holds a NaN or an inf, in order."""
    sums: dict[torch.device, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for name, tensor in named_tensors:
        if tensor.dtype in CHECKED_DTYPES and tensor.numel():
            sums[tensor.device].append((name, tensor.detach().sum(dtype=torch.float32)))
    bad = []
    for pairs in sums.values():
        finite = torch.isfinite(torch.stack([s for _, s in pairs])).tolist()  # one sync per device
        bad += [name for (name, _), ok in zip(pairs, finite) if not ok]
    return bad


def describe(bad: list[str]) -> str:
    """"3 tensors hold NaN or inf (model.layers.0.mlp.down_proj.weight, ...)"."""
    more = f", and {len(bad) - 1} more" if len(bad) > 1 else ""
    return f"{len(bad)} tensor{'s' if len(bad) > 1 else ''} hold NaN or inf ({bad[0]}{more})"
