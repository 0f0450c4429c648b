"""Causal depthwise conv1d of the Gated DeltaNet layers, over a pool of per-sequence conv states.

Each sequence keeps the last K-1 inputs of its conv (K = kernel width) in a
state slot: conv_states [num_slots, channels, K-1]. Prefill (varlen, several
sequences packed in one flat batch) reads each sequence's state as its left
context and writes the last K-1 inputs back; decode does the same for one
token per sequence. The state must hold zeros for a sequence starting at
position 0 (the engine zeroes fresh slots).

The `_ref` functions are plain torch (what the engine runs on the torch path);
`causal_conv1d_update` is the Triton decode kernel and `causal_conv1d_varlen`
the Triton prefill, each with its reference's arguments. triton is optional
(the test extra): without it the references still import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout_kernels.host_to_device import LastLayout, to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only installs run the references
    triton = None


def _activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return out
    if activation in ("silu", "swish"):
        return F.silu(out)
    raise ValueError(f"unsupported conv activation {activation!r}")


def causal_conv1d_varlen_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_states: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: list[int],
                             activation: str | None = "silu") -> torch.Tensor:
    """x [T, C] (sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]); weight [C, K]; bias [C] or None;
    conv_states [S, C, K-1] updated in place at state_indices [B] -> out [T, C] in x's dtype.

    The conv runs in the weight's dtype as HF's torch fallback does; the state keeps the raw inputs.
    """
    channels, width = weight.shape
    out = torch.empty_like(x)
    for b, slot in enumerate(state_indices.tolist()):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        if end == start:
            continue
        # [C, K-1 + L]: the stored left context, then this chunk's inputs
        window = torch.cat((conv_states[slot].to(weight.dtype), x[start:end].t().to(weight.dtype)), dim=-1)
        y = F.conv1d(window[None], weight[:, None, :], bias, groups=channels)[0]  # [C, L]
        out[start:end] = _activate(y, activation).t().to(x.dtype)
        conv_states[slot] = window[:, window.shape[1] - (width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_states: torch.Tensor, state_indices: torch.Tensor,
                             activation: str | None = "silu") -> torch.Tensor:
    """One new token per sequence: x [B, C]; conv_states [S, C, K-1] updated in place at
    state_indices [B] -> out [B, C] in x's dtype."""
    states = conv_states[state_indices]  # [B, C, K-1]
    window = torch.cat((states.to(weight.dtype), x[:, :, None].to(weight.dtype)), dim=-1)  # [B, C, K]
    y = (window * weight[None]).sum(-1)  # [B, C]
    if bias is not None:
        y = y + bias
    conv_states[state_indices] = window[:, :, 1:].to(conv_states.dtype)
    return _activate(y, activation).to(x.dtype)


def causal_conv1d_verify_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_states: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: list[int],
                             fork_slots: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """A step verifying drafts: sequence b is rows cu_seqlens[b]:cu_seqlens[b+1] (its last token and its
    drafts), each token the decode step from conv_states[state_indices[b]]; after its token j the state is
    also copied to slot fork_slots[b, j] (j < fork_slots.shape[1], slot >= 0). -> out [T, C]."""
    out = torch.empty_like(x)
    forks = fork_slots.tolist()
    for b, slot in enumerate(state_indices.tolist()):
        one = torch.tensor([slot], dtype=torch.long, device=x.device)
        for j, t in enumerate(range(cu_seqlens[b], cu_seqlens[b + 1])):
            out[t] = causal_conv1d_update_ref(x[t:t + 1], weight, bias, conv_states, one, activation)[0]
            if j < len(forks[b]) and forks[b][j] >= 0:
                conv_states[forks[b][j]] = conv_states[slot]
    return out


if triton is not None:

    @triton.jit
    def _causal_conv1d_update_kernel(
        x_ptr, w_ptr, b_ptr, state_ptr, index_ptr, o_ptr,
        sx0, sw0, ss0, ss1, so0, C,
        WIDTH: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    ):
        # one program: sequence b, channels [cb * BC, cb * BC + BC); window taps 0 .. WIDTH-2 are the
        # stored inputs (oldest first), tap WIDTH-1 the new token
        b = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
        taps = tl.arange(0, BW)
        slot = tl.load(index_ptr + b).to(tl.int64)
        mask_c = cols < tl.where(slot >= 0, C, 0)  # a negative slot (padding) touches nothing
        row = state_ptr + slot * ss0 + cols[:, None] * ss1
        x = tl.load(x_ptr + b * sx0 + cols, mask=mask_c, other=0.0).to(tl.float32)
        stored = tl.load(row + taps[None, :], mask=mask_c[:, None] & (taps[None, :] < WIDTH - 1), other=0.0)
        window = tl.where(taps[None, :] == WIDTH - 1, x[:, None], stored.to(tl.float32))  # [BC, BW]
        # taps summed one by one in order, as the prefill kernel sums them: a token's output has the
        # same bits whether it was decoded or prefilled (the on-policy mode relies on it)
        y = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            tap = tl.sum(tl.where(taps[None, :] == j, window, 0.0), axis=1)  # column j: one term, exact
            y += tap * tl.load(w_ptr + cols * sw0 + j, mask=mask_c, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        # shift the stored inputs left by one and append x (re-read, not shifted in registers)
        kept = tl.load(row + taps[None, :] + 1, mask=mask_c[:, None] & (taps[None, :] + 1 < WIDTH - 1), other=0.0)
        shifted = tl.where(taps[None, :] == WIDTH - 2, x[:, None], kept.to(tl.float32))
        tl.store(row + taps[None, :], shifted.to(state_ptr.dtype.element_ty),
                 mask=mask_c[:, None] & (taps[None, :] < WIDTH - 1))
        tl.store(o_ptr + b * so0 + cols, y.to(o_ptr.dtype.element_ty), mask=mask_c)


def _check_conv_args(x, weight, bias, conv_states, activation) -> tuple[int, int, int]:
    """The checks both Triton launchers share; x [rows, C], weight [C, K] -> (rows, C, K)."""
    assert activation in (None, "silu", "swish"), f"unsupported conv activation {activation!r}"
    rows, C = x.shape
    width = weight.shape[1]
    assert weight.shape == (C, width) and weight.stride(1) == 1, f"weight must be [C, K] row-major, got {weight.shape}"
    assert width >= 2, "a conv of width 1 keeps no state"
    assert bias is None or (bias.shape == (C,) and bias.stride(0) == 1)
    assert conv_states.dim() == 3 and conv_states.shape[1:] == (C, width - 1) and conv_states.stride(2) == 1, \
        f"conv_states must be [S, C, K-1] contiguous in the last dim, got {tuple(conv_states.shape)}"
    assert x.stride(1) == 1, "x must be contiguous in channels"
    return rows, C, width


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, state_indices: torch.Tensor,
                         activation: str | None = "silu") -> torch.Tensor:
    """Triton decode step, as causal_conv1d_update_ref (float32 math): x [B, C] (may be a strided view);
    weight [C, K]; bias [C] or None; conv_states [S, C, K-1] updated in place at state_indices [B] int64
    (a negative index skips the row, its output left unwritten) -> out [B, C] in x's dtype."""
    assert triton is not None, "causal_conv1d_update needs triton"
    B, C, width = _check_conv_args(x, weight, bias, conv_states, activation)
    assert state_indices.shape == (B,) and state_indices.dtype == torch.int64, "state_indices must be [B] int64"
    out = torch.empty((B, C), dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    block_c = min(triton.next_power_of_2(C), 256)
    _causal_conv1d_update_kernel[(B, triton.cdiv(C, block_c))](
        x, weight, bias if bias is not None else weight, conv_states, state_indices, out,
        x.stride(0), weight.stride(0), conv_states.stride(0), conv_states.stride(1), out.stride(0), C,
        WIDTH=width, BW=triton.next_power_of_2(width), BC=block_c, HAS_BIAS=bias is not None,
        SILU=activation is not None, num_warps=4,
    )
    return out


_BLOCK_T = 64  # rows of one varlen conv program


def _build_token_blocks(cu_seqlens: tuple[int, ...], block: int, device) -> tuple[torch.Tensor, ...]:
    starts, lens, seqs = [], [], []
    for b in range(len(cu_seqlens) - 1):
        for r in range(cu_seqlens[b], cu_seqlens[b + 1], block):
            starts.append(r)
            lens.append(min(block, cu_seqlens[b + 1] - r))
            seqs.append(b)
    cu = to_device(list(cu_seqlens), torch.int64, device)
    return cu, (to_device(starts, torch.int64, device), to_device(lens, torch.int32, device),
                to_device(seqs, torch.int32, device))


# -> (cu_seqlens [B + 1] int64, (first row [N] int64, rows [N] int32, sequence [N] int32) of each block of
# <= `block` rows), on the device; built once per step (every linear layer asks alike)
_token_blocks = LastLayout(_build_token_blocks)


if triton is not None:

    @triton.jit
    def _window_tap(x_ptr, state_ptr, pos, seq_start, slot, cols, mask_c, mask_r, sx0, ss0, ss1,
                    WIDTH: tl.constexpr):
        """Inputs at sequence positions pos [BT] for channels cols [BC] -> [BT, BC] float32: x's row
        seq_start + pos when pos >= 0, else the stored left context conv_states[slot, c, WIDTH - 1 + pos]."""
        from_x = mask_r & (pos >= 0)
        from_s = mask_r & (pos < 0)
        xv = tl.load(x_ptr + (seq_start + pos)[:, None] * sx0 + cols[None, :], mask=from_x[:, None] & mask_c[None, :],
                     other=0.0).to(tl.float32)
        sv = tl.load(state_ptr + slot * ss0 + cols[None, :] * ss1 + (WIDTH - 1 + pos)[:, None],
                     mask=from_s[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        return xv + sv

    @triton.jit
    def _causal_conv1d_varlen_kernel(
        x_ptr, w_ptr, b_ptr, state_ptr, index_ptr, cu_ptr, start_ptr, len_ptr, seq_ptr, o_ptr,
        sx0, sw0, ss0, ss1, so0, C,
        WIDTH: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
        PER_SEQ: tl.constexpr = False,
    ):
        # one program: a block of <= BT rows of one sequence, channels [cb * BC, cb * BC + BC);
        # out[t] = sum_j w[:, j] * input[t - (WIDTH - 1) + j], the input before the sequence's first row
        # coming from its conv state. Reads the state only: _conv_state_write_kernel updates it afterwards.
        # PER_SEQ: program b is sequence b whole (<= BT rows), its rows read from cu alone (no host blocks)
        blk = tl.program_id(0)
        cols = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
        mask_c = cols < C
        if PER_SEQ:
            seq = blk
            start = tl.load(cu_ptr + seq).to(tl.int64)
            n = (tl.load(cu_ptr + seq + 1) - start).to(tl.int32)
        else:
            start = tl.load(start_ptr + blk).to(tl.int64)
            n = tl.load(len_ptr + blk)
            seq = tl.load(seq_ptr + blk)
        seq_start = tl.load(cu_ptr + seq).to(tl.int64)
        slot = tl.load(index_ptr + seq).to(tl.int64)
        ri = tl.arange(0, BT)
        mask_r = ri < n
        pos = start - seq_start + ri.to(tl.int64)  # [BT] positions in the sequence
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(WIDTH):
            tap = _window_tap(x_ptr, state_ptr, pos - (WIDTH - 1) + j, seq_start, slot, cols, mask_c, mask_r,
                              sx0, ss0, ss1, WIDTH)
            acc += tap * tl.load(w_ptr + cols * sw0 + j, mask=mask_c, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        rows = start + ri.to(tl.int64)
        tl.store(o_ptr + rows[:, None] * so0 + cols[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=mask_r[:, None] & mask_c[None, :])

    @triton.jit
    def _conv_state_write_kernel(x_ptr, state_ptr, index_ptr, cu_ptr, sx0, ss0, ss1, C,
                                 WIDTH: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr):
        # one program: sequence b, channels [cb * BC, cb * BC + BC): state <- the last WIDTH - 1 inputs
        # (positions L - (WIDTH - 1) .. L - 1, older ones from the old state when L < WIDTH - 1)
        b = tl.program_id(0)
        cols = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
        seq_start = tl.load(cu_ptr + b).to(tl.int64)
        length = tl.load(cu_ptr + b + 1).to(tl.int64) - seq_start
        slot = tl.load(index_ptr + b).to(tl.int64)
        mask_c = cols < tl.where(slot >= 0, C, 0)  # a negative slot (a graph's padding entry) touches nothing
        taps = tl.arange(0, BW)
        mask_t = taps < WIDTH - 1
        window = _window_tap(x_ptr, state_ptr, length - (WIDTH - 1) + taps.to(tl.int64), seq_start, slot, cols,
                             mask_c, mask_t, sx0, ss0, ss1, WIDTH)  # [BW, BC], loaded before any store
        tl.store(state_ptr + slot * ss0 + cols[None, :] * ss1 + taps[:, None],
                 window.to(state_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])


if triton is not None:

    @triton.jit
    def _conv_fork_write_kernel(x_ptr, state_ptr, index_ptr, cu_ptr, fork_ptr, sx0, ss0, ss1, C, NF,
                                WIDTH: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr):
        # one program: sequence b, draft position j (program 2), channels [cb * BC, cb * BC + BC): fork slot
        # fork[b, j] <- the state after the sequence's token j, its last WIDTH - 1 inputs (older ones from
        # the old state); runs before the varlen conv rewrites the sequence's own slot
        b = tl.program_id(0)
        j = tl.program_id(2).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
        seq_start = tl.load(cu_ptr + b).to(tl.int64)
        length = tl.load(cu_ptr + b + 1).to(tl.int64) - seq_start
        fork = tl.load(fork_ptr + b * NF + j).to(tl.int64)
        # no fork slot, or past the sequence: nothing (one mask expression: interpreter-safe)
        mask_c = cols < tl.where(j < tl.where(fork >= 0, length, 0), C, 0)
        slot = tl.load(index_ptr + b).to(tl.int64)
        taps = tl.arange(0, BW)
        mask_t = taps < WIDTH - 1
        window = _window_tap(x_ptr, state_ptr, j + 1 - (WIDTH - 1) + taps.to(tl.int64), seq_start, slot, cols,
                             mask_c, mask_t, sx0, ss0, ss1, WIDTH)  # [BW, BC]
        tl.store(state_ptr + fork * ss0 + cols[None, :] * ss1 + taps[:, None],
                 window.to(state_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: list[int],
                         activation: str | None = "silu") -> torch.Tensor:
    """Triton prefill, as causal_conv1d_varlen_ref (float32 math): x [T, C] (may be a row-strided view;
    sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]); weight [C, K]; bias [C] or None; conv_states
    [S, C, K-1] updated in place at state_indices [B] int64 (distinct, >= 0) -> out [T, C] in x's dtype."""
    assert triton is not None, "causal_conv1d_varlen needs triton"
    T, C, width = _check_conv_args(x, weight, bias, conv_states, activation)
    B = len(cu_seqlens) - 1
    assert state_indices.shape == (B,) and state_indices.dtype == torch.int64, "state_indices must be [B] int64"
    assert cu_seqlens[0] == 0 and cu_seqlens[-1] == T, f"cu_seqlens must run from 0 to T={T}, got {cu_seqlens}"
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    cu, blocks = _token_blocks(cu_seqlens, _BLOCK_T, x.device)
    _launch_conv(x, weight, bias, conv_states, state_indices, cu, blocks, activation, out)
    return out


def _launch_conv(x, weight, bias, conv_states, state_indices, cu, blocks, activation, out,
                 max_rows: int = _BLOCK_T) -> None:
    """The varlen conv into out [T, C], then each sequence's new conv state: cu [B + 1] int64 on the device;
    blocks (first row, rows, sequence) of <= _BLOCK_T rows each (_token_blocks), or None for one program per
    sequence of at most `max_rows` rows, read from cu alone (a CUDA graph's static layout)."""
    C, width, B = x.shape[1], weight.shape[1], state_indices.shape[0]
    block_c = min(triton.next_power_of_2(C), 128)
    programs = B if blocks is None else blocks[0].shape[0]
    starts, lens, seqs = (cu, cu, cu) if blocks is None else blocks  # PER_SEQ reads none of the three
    # a program's row tile: a verify step's sequence holds 1 + drafts rows; with 64-row tiles this kernel was
    # the costliest of MTP's drafting steps on an H100 (session 40's profile: 25.9 us a call over 150 calls, 6
    # a verify step, a few of them prefill's). Each output element sums the same taps in the same order
    # whatever the tile.
    block_t = _BLOCK_T if blocks is not None else max(2, triton.next_power_of_2(max_rows))
    _causal_conv1d_varlen_kernel[(programs, triton.cdiv(C, block_c))](
        x, weight, bias if bias is not None else weight, conv_states, state_indices, cu, starts, lens, seqs, out,
        x.stride(0), weight.stride(0), conv_states.stride(0), conv_states.stride(1), out.stride(0), C,
        WIDTH=width, BT=block_t, BC=block_c, HAS_BIAS=bias is not None, SILU=activation is not None,
        PER_SEQ=blocks is None, num_warps=4,
    )
    _conv_state_write_kernel[(B, triton.cdiv(C, block_c))](
        x, conv_states, state_indices, cu, x.stride(0), conv_states.stride(0), conv_states.stride(1), C,
        WIDTH=width, BW=max(2, triton.next_power_of_2(width - 1)), BC=block_c, num_warps=4,
    )


def causal_conv1d_verify(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: list[int] | torch.Tensor,
                         fork_slots: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """A step verifying drafts, as causal_conv1d_verify_ref: the fork slots written first (the state after
    each draft position, read from the old state and the step's inputs), then the varlen conv (its taps
    summed in the decode kernel's order: each token's output has a decode's bits) writes the outputs and
    the final state. fork_slots [B, F] int64, -1: none.

    cu_seqlens may be a device tensor [B + 1] int64 (a CUDA graph's static layout: nothing read on the
    host): then each sequence has at most 1 + F rows (and at most 64), rows past cu_seqlens[B] are left
    unwritten, and a sequence of no rows may have state slot -1."""
    assert triton is not None, "causal_conv1d_verify needs triton"
    T, C, width = _check_conv_args(x, weight, bias, conv_states, activation)
    on_device = isinstance(cu_seqlens, torch.Tensor)
    B = cu_seqlens.shape[0] - 1 if on_device else len(cu_seqlens) - 1
    assert fork_slots.dim() == 2 and fork_slots.shape[0] == B and fork_slots.dtype == torch.int64 \
        and fork_slots.is_contiguous(), f"fork_slots must be [{B}, F] int64, contiguous"
    block_c, block_w = min(triton.next_power_of_2(C), 128), max(2, triton.next_power_of_2(width - 1))
    cu = cu_seqlens if on_device else to_device(cu_seqlens, torch.int64, x.device)
    if B and fork_slots.shape[1]:
        _conv_fork_write_kernel[(B, triton.cdiv(C, block_c), fork_slots.shape[1])](
            x, conv_states, state_indices, cu, fork_slots, x.stride(0), conv_states.stride(0), conv_states.stride(1),
            C, fork_slots.shape[1], WIDTH=width, BW=block_w, BC=block_c, num_warps=4,
        )
    if not on_device:
        return causal_conv1d_varlen(x, weight, bias, conv_states, state_indices, cu_seqlens, activation)
    assert cu.dtype == torch.int64 and state_indices.shape == (B,) and 1 + fork_slots.shape[1] <= _BLOCK_T
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    if B:
        _launch_conv(x, weight, bias, conv_states, state_indices, cu, None, activation, out,
                     max_rows=1 + fork_slots.shape[1])
    return out
