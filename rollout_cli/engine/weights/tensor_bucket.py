"""A flattened bucket: many named tensors packed into one uint8 buffer plus per-tensor metadata.

One buffer means one CUDA IPC handle (or one shared-memory segment, or one broadcast) for a
whole set of weights instead of one per tensor. Tensors of mixed dtypes share the buffer; each
starts at a multiple of ALIGN bytes so its slice can be viewed as its dtype without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_cli.errors import RolloutError

ALIGN = 16  # bytes; a multiple of every element size, and of 16-byte vector loads


@dataclass(frozen=True)
class FlatTensorMeta:
    name: str  # HF checkpoint name, e.g. model.layers.0.self_attn.q_proj.weight
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # first byte in the buffer (a multiple of ALIGN)

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class FlattenedBucket:
    buffer: torch.Tensor  # [total bytes] uint8, on the tensors' device
    metadata: tuple[FlatTensorMeta, ...]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def flatten_tensors(named_tensors) -> FlattenedBucket:
    """Pack (name, tensor) pairs (or a dict) into one bucket on their common device (one copy each)."""
    items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    if not items:
        raise RolloutError("flatten_tensors got no tensors")
    devices = {t.device for _, t in items}
    if len(devices) > 1:
        raise RolloutError(f"flatten_tensors needs tensors on one device, got {sorted(map(str, devices))}")
    metadata, offset = [], 0
    for name, tensor in items:
        metadata.append(FlatTensorMeta(name, tuple(tensor.shape), tensor.dtype, offset))
        offset = _aligned(offset + tensor.numel() * tensor.element_size())
    buffer = torch.zeros(offset, dtype=torch.uint8, device=devices.pop())
    with torch.no_grad():
        for meta, (_, tensor) in zip(metadata, items):
            # [numel] of the tensor's dtype -> [nbytes] uint8 (a strided tensor is copied contiguous first)
            raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
            buffer[meta.offset: meta.offset + raw.numel()].copy_(raw)
    return FlattenedBucket(buffer, tuple(metadata))


def unflatten_bucket(bucket: FlattenedBucket) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into the bucket's buffer, no copies; metadata that overruns the buffer is refused."""
    buffer = bucket.buffer
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise RolloutError(f"a flattened bucket's buffer must be 1-d uint8, got {buffer.dtype} of shape {tuple(buffer.shape)}")
    out = []
    for meta in bucket.metadata:
        size = torch.empty((), dtype=meta.dtype).element_size()
        end = meta.offset + meta.nbytes
        if meta.offset < 0 or (buffer.storage_offset() + meta.offset) % size or end > buffer.numel() or min(meta.shape, default=0) < 0:
            raise RolloutError(f"bucket metadata of {meta.name} (offset {meta.offset}, shape {meta.shape}, "
                               f"{meta.dtype}) does not fit a buffer of {buffer.numel()} bytes")
        out.append((meta.name, buffer[meta.offset: end].view(meta.dtype).view(meta.shape)))
    return out
