"""Give the engine's GPU memory to a trainer and take it back: the mechanism (MemorySaver.release /
resume); engine.control.RankOperations.release_memory / resume_memory run it with what goes around it.

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


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free


class MemorySaver:
    """The engine's release state (which tags are released, whether the weights are stale), and the
    release and resume of the tagged memory: the model's parameters (`weights`) and the cache pools
    (`kv_cache`: objects whose `storage_names` attributes are their cache-memory tensors, the KV pool
    and a hybrid model's state pool). What must happen around it (the prefix cache flushed, the decode
    graphs dropped and re-captured) is the caller's: engine.control."""

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
        self._cache_meta: list[tuple[object, str, tuple, torch.dtype]] = []

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


    def graphs_must_go(self, tags) -> bool:
        """Whether releasing `tags` invalidates the captured decode graphs: their own pool, or (the
        reallocate mechanism) tensors whose addresses they captured."""
        return "cuda_graph" in tags or (self.backend == "reallocate" and bool({"weights", "kv_cache"} & set(tags)))

    def release(self, tags, model, pools) -> None:
        """Free the memory of `tags` (already parsed, none released yet); returns once it is free."""
        sync_device(self.device)
        if self.backend == "torch_memory_saver":
            for tag in ("kv_cache", "weights"):
                if tag in tags:
                    self._tms.pause(tag)
        else:
            if "kv_cache" in tags:
                self._release_pools(pools)
            if "weights" in tags:
                self._release_weights(model)
        self.released.update(tags)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        sync_device(self.device)

    def resume(self, tags, model, pools) -> None:
        """Take back the memory of `tags` (already parsed, all released); cache pools come back zeroed."""
        if self.backend == "torch_memory_saver":
            for tag in ("weights", "kv_cache"):
                if tag in tags:
                    self._tms.resume(tag)
        else:
            if "weights" in tags:
                self._resume_weights(model)
            if "kv_cache" in tags:
                self._resume_pools()
        if "kv_cache" in tags:
            # Resumed pages hold whatever was there; the padding slot 0 is read by graph padding rows.
            for pool in pools:
                for name in pool.storage_names:
                    getattr(pool, name).zero_()
        if "weights" in tags and not self.weights_cpu_backup:
            self.weights_stale = True
        self.released.difference_update(tags)
        sync_device(self.device)

    # ---- the reallocate mechanism ---------------------------------------------------------

    def _release_weights(self, model) -> None:
        self._param_meta = {name: (p.shape, p.dtype) for name, p in model.named_parameters()}
        self._weights_backup = {}
        for name, p in model.named_parameters():
            if self.weights_cpu_backup:
                self._weights_backup[name] = p.data.to("cpu", copy=True)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _resume_weights(self, model) -> None:
        for name, p in model.named_parameters():
            shape, dtype = self._param_meta[name]
            backup = self._weights_backup.pop(name, None)
            p.data = backup.to(self.device) if backup is not None else torch.zeros(shape, dtype=dtype, device=self.device)

    def _release_pools(self, pools) -> None:
        self._cache_meta = []
        for pool in pools:
            for name in pool.storage_names:
                tensor = getattr(pool, name)
                self._cache_meta.append((pool, name, tuple(tensor.shape), tensor.dtype))
                setattr(pool, name, torch.empty(0, dtype=tensor.dtype, device=tensor.device))

    def _resume_pools(self) -> None:
        for pool, name, shape, dtype in self._cache_meta:
            setattr(pool, name, torch.zeros(shape, dtype=dtype, device=self.device))
