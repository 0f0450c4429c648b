"""Capture and replay of one step, on CUDA and, for the tests, on the CPU.

On a GPU a decode step's kernels are captured into a CUDA graph once and replayed each step
(cuda_graphs.DecodeGraphs). On the CPU, under Triton's interpreter, the same DecodeGraphs runs with
`CallReplay` in the graph's place: "capture" calls the step once and keeps its output tensor, and each
replay calls it again and copies the result into that tensor, as a graph writes its static output.
So the static-buffer path (bucket padding, PENDING tokens read from the token table, the verify and
head graphs, what a step hands back) runs, and is tested, on machines without a GPU.

What the CPU stand-in cannot show: a value the step computed on the host at capture, which a CUDA graph
would freeze (a replay re-runs the Python); capture-time allocation and synchronisation errors. The GPU
tests (tests/e2e/test_gpu_engine.py, test_gpu_hybrid.py) cover those.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable

import torch


@contextlib.contextmanager
def garbage_collection_paused():
    """Collect now, then not until the block ends (CUDA graph capture). The collector freeing a dead
    engine's CUDA graphs (held by a reference cycle) in the middle of a capture destroys graphs while a
    stream captures, which CUDA forbids: the capture is invalidated and its next kernel fails
    (CUBLAS_STATUS_EXECUTION_FAILED on the H100 when a test built a second engine). torch.cuda.graph no
    longer collects on entry."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CallReplay:
    """The CPU's stand-in for a captured CUDA graph of `step` (a function of static buffers -> one tensor)."""

    def __init__(self, step: Callable[[], torch.Tensor]):
        self.step = step
        self.output = step()  # the "static" output: replays write their results into it

    def replay(self) -> None:
        self.output.copy_(self.step())

    def pool(self):
        return None  # no memory pool to share


def capture(step: Callable[[], torch.Tensor], device: torch.device, pool=None):
    """Capture `step` -> (the graph, its static output tensor); on the CPU a CallReplay. Graphs given the same
    `pool` (an earlier graph's .pool()) share their memory: only one of them may run at a time."""
    if device.type != "cuda":
        replay = CallReplay(step)
        return replay, replay.output
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step()
    return graph, output


@contextlib.contextmanager
def side_stream(device: torch.device):
    """Warm-up work off the capture's stream (CUDA's rule for code later captured); nothing on the CPU."""
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_buffer(shape, dtype: torch.dtype, device: torch.device, fill: int = 0) -> torch.Tensor:
    """A staging buffer for device copies: pinned beside a GPU (an asynchronous DMA), plain on the CPU."""
    buffer = torch.full(shape if isinstance(shape, tuple) else (shape,), fill, dtype=dtype)
    return buffer.pin_memory() if device.type == "cuda" else buffer


class _Reached:
    """A CPU step's results are on the host when its launch returns: nothing to wait for."""

    def synchronize(self) -> None:
        pass


def results_ready_event(device: torch.device):
    """An event recorded now on the current stream: .synchronize() waits for the work queued before it."""
    if device.type != "cuda":
        return _Reached()
    event = torch.cuda.Event()
    event.record()
    return event


def best_seconds(run: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """The shortest of `repeats` wall times of run(), each waited for on the device."""
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        begin = time.perf_counter()
        run()
        synchronize(device)
        seconds.append(time.perf_counter() - begin)
    return min(seconds)
