"""Small host lists to the device without waiting for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes the stream: the
host waits for every kernel already queued. Between a step launched ahead (overlap scheduling) and its
post-processing that is the whole step in flight, so a pass queued behind it (the MTP head's, engine/
execution/mtp_step.py) made the host wait a full step each time. A pinned source copies asynchronously
(PyTorch's pinned-memory allocator keeps the buffer until the copy has run)."""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values (a list of ints or floats) -> a 1-D tensor on `device`, queued on the current stream
    without a host wait on CUDA; a plain tensor elsewhere."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
