"""The on-policy mode's check, shared by its CPU, interpreter and GPU tests: samples bit for bit equal."""

from __future__ import annotations


def assert_same_bits(got: dict, want: dict) -> None:
    """got, want: {(prompt_index, sample_index): Trajectory}. Every sample of `got` (at least one) is in
    `want` with the same token ids and logprobs; float lists compare exactly, so bit for bit (no NaN here)."""
    assert got and got.keys() <= want.keys()
    for key in sorted(got):
        assert got[key].response_token_ids == want[key].response_token_ids, key
        assert got[key].response_logprobs == want[key].response_logprobs, key
