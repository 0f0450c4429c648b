"""Flattened buckets and serialized tensor handles (engine/weights/tensor_bucket.py, engine/weights/tensor_ipc.py)."""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch

from rollout_cli.engine.weights.tensor_bucket import ALIGN, FlatTensorMeta, FlattenedBucket, flatten_tensors, unflatten_bucket
from rollout_cli.engine.weights.tensor_ipc import deserialize_named_tensors, serialize_named_tensors
from rollout_cli.errors import RolloutError

def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=g),  # 60 bytes: the next offset must be padded to ALIGN
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "strided": torch.randn(4, 6, generator=g)[:, ::2],  # not contiguous
        "empty": torch.empty(0, 3),
        "ints": torch.arange(5, dtype=torch.int64),
        "half": torch.randn(2, 3, generator=g).half(),
    }


def test_bucket_round_trip_is_exact_with_aligned_offsets():
    tensors = _mixed()
    bucket = flatten_tensors(tensors)
    assert bucket.buffer.dtype == torch.uint8 and bucket.buffer.dim() == 1
    assert [m.name for m in bucket.metadata] == list(tensors)  # order kept
    assert all(m.offset % ALIGN == 0 for m in bucket.metadata)
    ends = [m.offset + m.nbytes for m in bucket.metadata]
    assert all(end <= nxt for end, nxt in zip(ends, [m.offset for m in bucket.metadata[1:]]))  # no overlap
    out = unflatten_bucket(bucket)
    assert [n for n, _ in out] == list(tensors)
    for name, tensor in out:
        assert tensor.dtype == tensors[name].dtype and tensor.shape == tensors[name].shape
        assert torch.equal(tensor, tensors[name]), name
        assert tensor.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()  # views, no copies


def test_flatten_refuses_nothing_and_mixed_devices():
    with pytest.raises(RolloutError, match="got no tensors"):
        flatten_tensors({})
    meta_device = {"a": torch.zeros(2), "b": torch.zeros(2, device="meta")}
    with pytest.raises(RolloutError, match="on one device"):
        flatten_tensors(meta_device)


@pytest.mark.parametrize("meta, reason", [
    (FlatTensorMeta("big", (100,), torch.float32, 0), "does not fit a buffer of 64 bytes"),
    (FlatTensorMeta("odd", (2,), torch.float32, 2), "does not fit"),  # misaligned for float32
    (FlatTensorMeta("neg", (2,), torch.float32, -16), "does not fit"),
])
def test_bucket_metadata_that_overruns_the_buffer_is_refused(meta, reason):
    bucket = FlattenedBucket(torch.zeros(64, dtype=torch.uint8), (meta,))
    with pytest.raises(RolloutError, match=reason):
        unflatten_bucket(bucket)
    with pytest.raises(RolloutError, match="must be 1-d uint8"):
        unflatten_bucket(FlattenedBucket(torch.zeros(4), ()))


@pytest.mark.parametrize("flatten", [False, True])
def test_serialized_handles_round_trip(flatten):
    tensors = _mixed()
    payload = serialize_named_tensors(flatten_tensors(tensors) if flatten else tensors)
    assert isinstance(payload, str) and len(payload) < 8000  # handles only
    out = deserialize_named_tensors(payload)
    pairs = unflatten_bucket(out) if flatten else out
    assert [n for n, _ in pairs] == list(tensors)
    for name, tensor in pairs:
        assert torch.equal(tensor, tensors[name]), name


def test_payload_that_names_code_is_refused_in_one_line():
    evil = base64.b64encode(pickle.dumps(os.system)).decode()
    with pytest.raises(RolloutError, match=r"names posix\.system, which is not a tensor handle") as err:
        deserialize_named_tensors(evil)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("payload, reason", [
    ("not base64 !!", "is not base64"),
    (base64.b64encode(pickle.dumps({"a": 1})).decode(), "holds a dict, not what serialize_named_tensors makes"),
    (base64.b64encode(pickle.dumps(({}, pickle.dumps({"a": 1})))).decode(), "holds a dict, not .name, tensor. pairs"),
    (base64.b64encode(pickle.dumps(({0: "GPU-none"}, b""))).decode(), "on a GPU but this engine process sees none"),
    (base64.b64encode(b"\x80\x05garbage").decode(), "cannot rebuild the serialized tensors"),
])
def test_bad_payloads_are_refused(payload, reason):
    with pytest.raises(RolloutError, match=reason):
        deserialize_named_tensors(payload)
