"""A process group for broadcasting weights from a trainer to the engine, apart from torch.distributed's
default group (neither side needs one, and a trainer's own default group is left alone).

Rank 0 is the trainer (it hosts the TCPStore at master_address:master_port); the engine is rank
`rank_offset` of `world_size`. The backend is built directly on a prefixed store: NCCL on GPU,
gloo on CPU. Both sides call `open_weight_group`; the trainer then `broadcast_tensors`, the
engine receives into staging buffers (engine/weights/weight_updates.py). Collectives match up in
order, so both sides must broadcast the same tensors (names, shapes, dtypes) in the same order.

Trainer side, next to a running daemon (the POST blocks until the tensors arrived, so it runs in
a thread while the trainer broadcasts):

    client = EngineClient(address)                                  # rollout_cli.server.client
    joined = pool.submit(client.init_weights_update_group, host, port, 1, 2, "weights", "nccl")
    group = open_weight_group(host, port, 0, 2, "weights", "nccl", torch.device("cuda:0"))
    joined.result()
    answer = pool.submit(client.update_weights_from_distributed, **broadcast_metadata(named), group_name="weights")
    broadcast_tensors(group, [tensor for _, tensor in named])
    answer.result()["weight_version"]
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rollout_cli.errors import RolloutError

BACKENDS = ("nccl", "gloo")


@dataclass
class WeightGroup:
    name: str
    rank: int
    world_size: int
    backend: str
    device: torch.device  # where broadcast tensors live: cuda for nccl, cpu for gloo
    store: dist.TCPStore
    process_group: object  # dist.ProcessGroupGloo or dist.ProcessGroupNCCL, used directly

    def broadcast(self, tensor: torch.Tensor) -> None:
        """One broadcast from rank 0; in place on every other rank."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.process_group.broadcast([tensor], opts).wait()

    def close(self) -> None:
        shutdown = getattr(self.process_group, "shutdown", None)  # NCCL: free the communicator now
        if self.backend == "nccl" and shutdown is not None:
            shutdown()
        self.process_group = None
        self.store = None


def open_weight_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str, device: torch.device, timeout_seconds: float = 600.0) -> WeightGroup:
    """Join the group; blocks until all `world_size` ranks joined (or `timeout_seconds` passed)."""
    if backend not in BACKENDS:
        raise RolloutError(f"unknown backend {backend!r}; choose nccl (GPU) or gloo (CPU)")
    if not 0 <= rank < world_size:
        raise RolloutError(f"rank {rank} is outside a group of {world_size}")
    if backend == "nccl" and device.type != "cuda":
        raise RolloutError("the nccl backend needs the engine on a CUDA device; use gloo on the CPU")
    if not group_name:
        raise RolloutError("group_name must not be empty")
    timeout = timedelta(seconds=timeout_seconds)
    try:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout)
        prefixed = dist.PrefixStore(f"rollout_weights/{group_name}/", store)
        if backend == "gloo":
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            device = torch.device("cpu")
        else:
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            torch.cuda.set_device(device)  # the communicator binds to the current device
            group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    except (RuntimeError, ValueError, OSError) as err:  # TCPStore/backends raise DistStoreError etc. (RuntimeError)
        raise RolloutError(f"cannot join weight update group {group_name!r} at {master_address}:{master_port} "
                           f"as rank {rank} of {world_size}: {err}".splitlines()[0]) from err
    return WeightGroup(group_name, rank, world_size, backend, device, store, group)


def broadcast_metadata(named_tensors) -> dict:
    """Trainer side: the names/dtypes/shapes fields of /update_weights_from_distributed (and of
    Engine.update_weights_from_distributed) for these (name, tensor) pairs, in broadcast order."""
    named = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    return {"names": [name for name, _ in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}


def broadcast_tensors(group: WeightGroup, tensors) -> None:
    """Trainer side (rank 0): send each tensor, in order; they must be on group.device and contiguous."""
    for tensor in tensors:
        group.broadcast(tensor.detach().contiguous())
