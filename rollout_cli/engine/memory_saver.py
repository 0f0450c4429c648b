"""Give the engine's GPU memory to a trainer and take it back: release_memory / resume_memory.

Three tags, as in SGLang: `weights` (the model's parameters), `kv_cache` (the KV pool) and
`cuda_graph` (the memory pool of the captured decode graphs).

Two mechanisms, chosen once when the engine starts:
- torch_memory_saver (CUDA, when the package is installed): weights and the KV pool are
  allocated inside its tagged regions; release unmaps their physical memory and resume maps new
  memory at the same virtual addresses, so tensors, and graphs that captured their pointers,
  stay valid. `weights_cpu_backup` makes it copy the weights to pinned host memory on release
  and back on resume.
- reallocate (CPU, or CUDA without the package): release swaps each tensor's storage for an
  empty one (after copying the weights to the host if backed up); resume allocates new storage.
  Addresses change, so the decode graphs are dropped and re-captured.
The `cuda_graph` tag drops the captured graphs and frees their pool; resume re-captures them
(the kernels are compiled by then, so this takes about a second).

Without a weights backup the resumed weights hold garbage: the engine refuses to generate until
new weights are loaded (reload-weights / update_weights_*). After a KV release the prefix cache
is flushed (its KV is gone) and the resumed pool is zeroed.
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch

from rollout_cli.errors import RolloutError

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def parse_tags(tags) -> tuple[str, ...]:
    """None / [] -> all tags; a list or comma-separated string -> its tags, checked, in canonical order."""
    if tags is None:
        return MEMORY_TAGS
    if isinstance(tags, str):
        tags = [t for t in tags.split(",")]
    names = {t.strip() for t in tags if t.strip()}
    if not names:
        return MEMORY_TAGS
    unknown = sorted(names - set(MEMORY_TAGS))
    if unknown:
        raise RolloutError(f"unknown memory tag(s) {', '.join(unknown)}; choose from {', '.join(MEMORY_TAGS)}")
    return tuple(t for t in MEMORY_TAGS if t in names)


def _load_torch_memory_saver():
    try:
        from torch_memory_saver import torch_memory_saver
    except ImportError:
        return None
    # "torch" hook mode: the package's allocator is plugged into PyTorch's, no LD_PRELOAD needed.
    # The mode can only be set before the singleton's first use (a second Engine in the process).
    try:
        torch_memory_saver.hook_mode = "torch"
    except AttributeError:
        pass
    return torch_memory_saver


class MemorySaver:
    """The engine's release state: which tags are released, whether the weights are stale."""

    def __init__(self, device: torch.device, weights_cpu_backup: bool = False):
        self.device = device
        self.weights_cpu_backup = weights_cpu_backup
        self._tms = _load_torch_memory_saver() if device.type == "cuda" else None
        self.backend = "torch_memory_saver" if self._tms is not None else "reallocate"
        self.released: set[str] = set()
        self.weights_stale = False  # resumed without a backup and not reloaded since
        # reallocate mechanism: what release took away, to rebuild on resume
        self._param_meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._weights_backup: dict[str, torch.Tensor] = {}
        self._kv_shape: tuple | None = None

    @contextlib.contextmanager
    def region(self, tag: str):
        """Allocations inside belong to `tag` (torch_memory_saver); a no-op for the reallocate mechanism."""
        if self._tms is None:
            yield
            return
        with self._tms.region(tag=tag, enable_cpu_backup=tag == "weights" and self.weights_cpu_backup):
            yield

    def keep_only_parameters(self, model) -> None:
        """Copy every non-parameter tensor that model construction left in the weights region (tables,
        buffers) out of it: a weights release without backup must lose nothing a reload cannot restore."""
        if self._tms is None:
            return
        for module in model.modules():
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and value.is_cuda:
                    setattr(module, name, value.clone())
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_cuda:
                    module._buffers[name] = buffer.clone()

    # ---- checks the engine makes before it touches released memory ---------------------------

    def check_can_generate(self) -> None:
        if self.released:
            released = ", ".join(t for t in MEMORY_TAGS if t in self.released)
            raise RolloutError(f"the engine's memory is released ({released}); "
                               "run `rollout resume-memory` first")
        if self.weights_stale:
            raise RolloutError("the weights were released without --weights-cpu-backup and not reloaded since; "
                               "load weights first (rollout reload-weights CKPT_DIR)")

    def check_weights_writable(self) -> None:
        if "weights" in self.released:
            raise RolloutError("the weights are released; run `rollout resume-memory` before loading new weights")

    def weights_loaded(self) -> None:
        """Called after every successful weight update."""
        self.weights_stale = False

    def state(self) -> dict:
        return {"backend": self.backend, "released": [t for t in MEMORY_TAGS if t in self.released], "weights_stale": self.weights_stale,
                "weights_cpu_backup": self.weights_cpu_backup}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_device_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free


def release_memory(engine, tags=None) -> dict:
    """Free the memory of `tags` (default: all); returns what was released and how long it took.

    Refused while requests are in flight. Returns only after the memory is free: the device is
    synchronised before and after, and the caching allocator's unused blocks are returned.
    """
    tags = parse_tags(tags)
    saver: MemorySaver = engine.memory
    if engine.scheduler.has_work():
        raise RolloutError("cannot release memory while requests are in flight; "
                           "stop the job first (rollout pause --mode abort, or rollout abort)")
    todo = [t for t in tags if t not in saver.released]
    started = time.perf_counter()
    free_before = _free_device_bytes(engine.device)
    _sync(engine.device)
    if "kv_cache" in todo and engine.scheduler.cache is not None:
        engine.scheduler.cache.reset()  # cached prefixes point into the KV being released
    graphs_go = "cuda_graph" in todo or (saver.backend == "reallocate" and {"weights", "kv_cache"} & set(todo))
    if graphs_go:
        engine.runner.drop_cuda_graphs()
    if saver.backend == "torch_memory_saver":
        for tag in ("kv_cache", "weights"):
            if tag in todo:
                saver._tms.pause(tag)
    else:
        if "kv_cache" in todo:
            _release_kv(saver, engine.kv)
        if "weights" in todo:
            _release_weights(saver, engine.model)
    saver.released.update(todo)
    gc.collect()
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    _sync(engine.device)
    return {"released": todo, "already_released": [t for t in tags if t not in todo],
            "seconds": time.perf_counter() - started, "free_bytes_before": free_before,
            "free_bytes_after": _free_device_bytes(engine.device)}


def resume_memory(engine, tags=None) -> dict:
    """Take back the memory of `tags` (default: all released ones); re-capture dropped graphs."""
    tags = parse_tags(tags)
    saver: MemorySaver = engine.memory
    todo = [t for t in tags if t in saver.released]
    started = time.perf_counter()
    if saver.backend == "torch_memory_saver":
        for tag in ("weights", "kv_cache"):
            if tag in todo:
                saver._tms.resume(tag)
    else:
        if "weights" in todo:
            _resume_weights(saver, engine.model, engine.device)
        if "kv_cache" in todo:
            _resume_kv(saver, engine.kv, engine.device)
    if "kv_cache" in todo:
        # Resumed pages hold whatever was there; the padding slot 0 is read by graph padding rows.
        engine.kv.k.zero_()
        engine.kv.v.zero_()
    if "weights" in todo and not saver.weights_cpu_backup:
        saver.weights_stale = True
    saver.released.difference_update(todo)
    capture_seconds = None
    # Graphs come back once everything they point at is back.
    if not saver.released & {"weights", "kv_cache", "cuda_graph"} and engine.runner.graphs_dropped:
        capture_seconds = engine.runner.recapture_cuda_graphs()
    _sync(engine.device)
    return {"resumed": todo, "not_released": [t for t in tags if t not in todo],
            "seconds": time.perf_counter() - started, "cuda_graph_capture_seconds": capture_seconds,
            "weights_stale": saver.weights_stale, "free_bytes_after": _free_device_bytes(engine.device)}


# ---- the reallocate mechanism ---------------------------------------------------------------

def _release_weights(saver: MemorySaver, model) -> None:
    saver._param_meta = {name: (p.shape, p.dtype) for name, p in model.named_parameters()}
    saver._weights_backup = {}
    for name, p in model.named_parameters():
        if saver.weights_cpu_backup:
            saver._weights_backup[name] = p.data.to("cpu", copy=True)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _resume_weights(saver: MemorySaver, model, device: torch.device) -> None:
    for name, p in model.named_parameters():
        shape, dtype = saver._param_meta[name]
        backup = saver._weights_backup.pop(name, None)
        p.data = backup.to(device) if backup is not None else torch.zeros(shape, dtype=dtype, device=device)


def _release_kv(saver: MemorySaver, kv) -> None:
    saver._kv_shape = (tuple(kv.k.shape), kv.k.dtype)
    kv.k = torch.empty(0, dtype=kv.k.dtype, device=kv.k.device)
    kv.v = torch.empty(0, dtype=kv.v.dtype, device=kv.v.device)


def _resume_kv(saver: MemorySaver, kv, device: torch.device) -> None:
    shape, dtype = saver._kv_shape
    kv.k = torch.zeros(shape, dtype=dtype, device=device)
    kv.v = torch.zeros(shape, dtype=dtype, device=device)
