"""Small host lists to the device without waiting for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes the stream: the
host waits for every kernel already queued. Between a step launched ahead (overlap scheduling) and its
post-processing that is the whole step in flight, so a pass queued behind it (the MTP head's, engine/
execution/mtp_step.py) made the host wait a full step each time; inside an eager forward, a layer's index
lists (a hybrid's chunk plan and conv blocks, per linear layer) made the host wait for every layer before
it, so the GPU then idled while the host launched the rest. A pinned source copies asynchronously
(PyTorch's pinned-memory allocator keeps the buffer until the copy has run)."""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values (a list of ints or floats, or equal-length lists of them) -> a tensor on `device`, queued on
    the current stream without a host wait on CUDA; a plain tensor elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class LastLayout:
    """A one-entry memo of a step's index tensors: every linear layer of a forward passes the same
    cu_seqlens, so the lists are built and uploaded once per step, not once per layer. The tensors are
    only read (kernel arguments); a new key replaces the entry."""

    def __init__(self, build):
        self.build = build  # (cu_seqlens tuple, block, device) -> tensors
        self._entry = (None, None)  # (key, tensors), replaced whole: a reader never pairs a key with another's

    def __call__(self, cu_seqlens, block: int, device):
        key = (tuple(cu_seqlens), block, torch.device(device))
        entry = self._entry
        if entry[0] != key:
            entry = self._entry = (key, self.build(*key))
        return entry[1]
