"""Index lists to the device: one upload per step for every layer that asks alike (LastLayout)."""

from __future__ import annotations

import torch

from rollout_kernels.chunk_gated_delta_rule import chunk_plan
from rollout_kernels.host_to_device import LastLayout, to_device


def test_a_layout_is_built_once_per_key_and_rebuilt_for_another():
    calls = []

    def build(cu, block, device):
        calls.append((cu, block))
        return to_device(list(cu), torch.int64, device)

    layout = LastLayout(build)
    first = layout([0, 3, 7], 4, "cpu")
    assert layout((0, 3, 7), 4, torch.device("cpu")) is first  # every layer of the step: the same tensors
    assert calls == [((0, 3, 7), 4)]
    assert layout([0, 3, 8], 4, "cpu").tolist() == [0, 3, 8]  # the next step's layout replaces it
    assert layout([0, 3, 8], 2, "cpu") is not layout([0, 3, 8], 4, "cpu")  # the block size is part of the key
    assert len(calls) == 4


def test_chunk_plan_splits_each_sequence_into_chunks():
    starts, lens, offsets = chunk_plan([0, 5, 5, 12], 4, "cpu")
    assert starts.tolist() == [0, 4, 5, 9] and lens.tolist() == [4, 1, 4, 3]
    assert offsets.tolist() == [0, 2, 2, 4]  # the empty sequence owns no chunk
    assert starts.dtype == torch.int64 and lens.dtype == torch.int32


def test_nested_lists_keep_their_shape():
    assert to_device([[1, -1], [2, 3]], torch.long, torch.device("cpu")).shape == (2, 2)
