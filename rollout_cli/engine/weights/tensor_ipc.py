"""Named tensors handed from a trainer process to the engine process on the same machine.

The trainer calls `serialize_named_tensors(named_tensors or a FlattenedBucket)` and sends the
returned text (JSON-safe base64) to the engine: as `serialized_named_tensors` of the daemon's
/update_weights_from_tensor, or to `Engine.update_weights_from_tensor` in another process.
No tensor data is copied into the payload, only handles (torch.multiprocessing's reductions):

- CUDA tensors travel as CUDA IPC handles; the engine maps the trainer's memory and copies
  from it. Handles are opened on the engine's index of the GPU with the same UUID (the index
  may differ between the processes under different CUDA_VISIBLE_DEVICES).
- CPU tensors are moved into shared memory (in place, in the trainer) and travel by the name of
  their /dev/shm segment (torch's "file_system" sharing strategy, set for the pickling only): the
  default "file_descriptor" strategy hands descriptors out only to processes that share the
  trainer's multiprocessing authkey, which a daemon started on its own does not.

Either way the trainer process must keep the tensors alive until the engine answered, which it
does while it waits on the HTTP call or on the Engine method. Shared-memory segments of a payload
the engine never consumed are unlinked by torch_shm_manager when the trainer process exits.

The engine unpickles with an allow-list (torch's rebuild functions, tensor and storage classes,
dtypes, the bucket classes): a payload can name memory to map, not code to run.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

from rollout_cli.engine.weights.tensor_bucket import FlattenedBucket
from rollout_cli.errors import RolloutError

_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED = {
    (_REDUCTIONS, name) for name in ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage",
                                     "rebuild_typed_storage_child", "rebuild_storage_fd",
                                     "rebuild_storage_filename", "rebuild_storage_empty")
} | {
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "UntypedStorage"), ("torch", "TypedStorage"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch.nn.parameter", "Parameter"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("rollout_cli.engine.weights.tensor_bucket", "FlattenedBucket"), ("rollout_cli.engine.weights.tensor_bucket", "FlatTensorMeta"),
}
_CUDA_DEVICE_ARG = 6  # position of storage_device in rebuild_cuda_tensor's arguments


def _cuda_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def serialize_named_tensors(named_tensors) -> str:
    """Trainer side: (name, tensor) pairs, a dict or a FlattenedBucket -> base64 text of their handles.

    The text is a pickle of (cuda_devices, handles): cuda_devices maps the trainer's GPU indices of
    the tensors to device UUIDs, so the engine opens each handle on the same physical GPU even when
    the two processes number their GPUs differently (CUDA_VISIBLE_DEVICES).
    """
    if isinstance(named_tensors, dict):
        named_tensors = list(named_tensors.items())
    if isinstance(named_tensors, FlattenedBucket):
        tensors = [named_tensors.buffer]
    else:
        named_tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        tensors = [tensor for _, tensor in named_tensors]
    cuda_devices = {t.device.index: _cuda_uuid(t.device.index) for t in tensors if t.is_cuda}
    buf = io.BytesIO()
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")  # read by reduce_storage while pickling
    try:
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(named_tensors)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    return base64.b64encode(pickle.dumps((cuda_devices, buf.getvalue()), pickle.HIGHEST_PROTOCOL)).decode("ascii")


class _HandleUnpickler(pickle.Unpickler):
    """Allow-listed globals only; CUDA handles are opened on the engine's index of their GPU."""

    def __init__(self, data: bytes, device_map: dict[int, int]):
        super().__init__(io.BytesIO(data))
        self.device_map = device_map  # trainer's GPU index -> engine's index of the same GPU

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in _ALLOWED:
            raise RolloutError(f"the payload names {module}.{name}, which is not a tensor handle; "
                               "build it with rollout_cli.engine.weights.tensor_ipc.serialize_named_tensors")
        found = super().find_class(module, name)
        if name != "rebuild_cuda_tensor":
            return found
        device_map = self.device_map

        def on_the_same_gpu(*args):
            args = list(args)
            args[_CUDA_DEVICE_ARG] = device_map[args[_CUDA_DEVICE_ARG]]
            return found(*args)

        return on_the_same_gpu


def _device_map(cuda_devices: dict[int, str]) -> dict[int, int]:
    if not cuda_devices:
        return {}
    if not torch.cuda.is_available():
        raise RolloutError("the tensors are on a GPU but this engine process sees none; "
                           "serialize CPU tensors or run the engine on that GPU")
    local = {_cuda_uuid(i): i for i in range(torch.cuda.device_count())}
    missing = [uuid for uuid in cuda_devices.values() if uuid not in local]
    if missing:
        raise RolloutError(f"the tensors live on GPU {missing[0]}, which this engine process cannot see "
                           "(CUDA_VISIBLE_DEVICES); CUDA IPC works only between processes on the same GPU")
    return {index: local[uuid] for index, uuid in cuda_devices.items()}


def deserialize_named_tensors(payload: str | bytes):
    """Engine side: the payload -> list of (name, tensor) or a FlattenedBucket (tensors map the trainer's memory)."""
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise RolloutError(f"serialized_named_tensors is not base64 ({err}); "
                           "build it with rollout_cli.engine.weights.tensor_ipc.serialize_named_tensors") from err
    try:
        header = _HandleUnpickler(data, {}).load()
        if not (isinstance(header, tuple) and len(header) == 2 and isinstance(header[0], dict)
                and isinstance(header[1], bytes)):
            raise RolloutError(f"the payload holds a {type(header).__name__}, not what serialize_named_tensors makes; "
                               "build it with rollout_cli.engine.weights.tensor_ipc.serialize_named_tensors")
        obj = _HandleUnpickler(header[1], _device_map(header[0])).load()
    except RolloutError:
        raise
    except Exception as err:  # noqa: BLE001 - unpickling and mapping raise many types; one line for the caller
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise RolloutError(f"cannot rebuild the serialized tensors ({type(err).__name__}: {reason}); the trainer "
                           "process must stay alive, on this machine, until the engine answered") from err
    if isinstance(obj, FlattenedBucket):
        return obj
    if isinstance(obj, list) and all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                                     and isinstance(item[1], torch.Tensor) for item in obj):
        return obj
    raise RolloutError(f"the payload holds a {type(obj).__name__}, not (name, tensor) pairs or a FlattenedBucket")
