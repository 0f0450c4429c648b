"""CUDA graphs for decode steps: one graph per batch-size bucket, captured once.

A decode step of B requests replays the graph of the smallest bucket >= B.
Inputs live in static device buffers, filled from pinned host buffers each
step; the graph itself records each request's new slot in req_to_token,
samples the next tokens and stores them in the token table (token_table.py),
where a step scheduled ahead reads its PENDING inputs.
Bucket entries past B are padding: they use row `pad_row` of req_to_token
(slot 0), attend one key, and write their k/v into slot 0, which the slot
allocator never hands out. Prefill steps run eagerly.

Hybrid linear-attention models also read each row's state slot from the ints buffer (row
`_STATE_SLOT`; padding rows use slot 0, the pool's reserved padding slot) through a decode-only
`LinearBatch`; the runner applies the step's state copies and zeroing before the replay.

MoE models record their expert ids into a `GraphRoutingBuffer` while the graphs are captured
(rows [0, B) after a replay of B tokens), whatever recorder the model has outside the graphs;
`routing_rows` hands them to the runner, which stores them in the routing pool when capture is on.

On the CPU (Triton's interpreter) the same class runs with graph_replay.CallReplay in each graph's place,
which re-runs the step: how CI tests this path (tests/kernels/test_engine_graph_replay.py).
"""

from __future__ import annotations

import time

import torch

from rollout_cli.engine.execution.graph_buckets import batch_buckets
from rollout_cli.engine.execution.graph_replay import (best_seconds, capture, garbage_collection_paused,
                                                        host_buffer, side_stream, synchronize)
from rollout_cli.engine.execution.linear_state import HybridBatch, LinearBatch
from rollout_cli.engine.execution.mtp_chain import ChainedDrafts
from rollout_cli.engine.execution.prefix_groups import PrefixGroups, group_shared_prefixes
from rollout_cli.engine.execution.routing_pool import GraphRoutingBuffer
from rollout_cli.engine.execution.sampler import FLOAT_PADDING, NUM_FLOAT_ROWS, NUM_INT_ROWS, SamplingRows, sample_rows
from rollout_cli.engine.execution.token_table import TokenTable
from rollout_cli.engine.execution.triton_attention import (SharedPrefixMetadata, TritonAttentionBatch,
                                                           invariant_decode_attention, warm_decode_splits)
from rollout_cli.engine.execution.verify_ahead import AheadTables
from rollout_cli.engine.execution.verify_layout import VerifyLayout
from rollout_cli.models.moe import routing_recorder_swapped


# rows of the int64 input buffer: the step's inputs (a PENDING token is read from the token table), the
# linear-state slot (hybrid models; never read by others), the rotary position (the position, but past a
# prompt with images: position + Request.rope_delta), whether the row is shifted on the device (a verify step
# planned ahead: verify_ahead.py), then the sampler's int table (engine.execution.sampler.SamplingRows.int_rows)
# from row _SAMPLING on, the drawn token's position (its random key) at _SAMPLING + 3
_TOKEN, _POSITION, _ROW, _SLOT, _STATE_SLOT, _ROPE_POSITION, _SHIFTED = range(7)
_SAMPLING = 7
_SAMPLE_POSITION = _SAMPLING + 3
_NUM_INT_ROWS = _SAMPLING + NUM_INT_ROWS
# the float32 input buffer is the sampler's float table (SamplingRows.float_rows)
# --shared-prefix-attention: rows of the int32 group buffer (order, group starts, prefix lengths)
_ORDER, _GROUP_STARTS, _PREFIX_LENS = range(3)
MAX_SHARED_GROUPS = 64  # groups of a replay that share a prefix; more stay alone (64 prompts x n 4 at batch 256)


def group_slots(bucket: int) -> int:
    """Group slots of a bucket's graph: groups of two or more, and the group of requests alone."""
    return min(bucket // 2, MAX_SHARED_GROUPS) + 1


def _attention_heads(model) -> int:
    """Query heads of the model's (full) attention layers; a hybrid model's first layer may be linear."""
    return next(layer.self_attn for layer in model.model.layers if getattr(layer, "self_attn", None)).num_heads


class DecodeGraphs:
    """Each graph runs a whole decode step: forward, logits, and the Triton sampler with its
    counter-based keys, ending in one float64 [2, bucket] tensor (token ids, logprobs) that the
    host reads with a single device-to-host copy. Sampling inside the graph removes the launches
    and the host-to-device copies that would otherwise sit between the forward and the read."""

    def __init__(self, model, kv, req_to_token: torch.Tensor, tokens: TokenTable, pad_row: int, scale: float,
                 max_batch: int, linear_states=None, deterministic: bool = False, keep_hidden: bool = False,
                 shared_prefix: bool = False, verify_rows: int | None = None, hybrid_verify_drafts: int = 0):
        self.model = model
        self.tokens = tokens  # each row's last sampled token: read for PENDING inputs, written by every replay
        self.kv = kv
        self.linear_states = linear_states  # hybrid models: engine.linear_state.LinearStatePool
        self.req_to_token = req_to_token
        self.pad_row = pad_row
        self.scale = scale
        self.deterministic = deterministic  # the on-policy mode: the batch-invariant attention
        self.device = device = req_to_token.device
        # a hybrid's verify steps replay graphs of their own, whose linear layers read a VerifyLayout
        self.verify = None
        self.verify_buckets: list[int] = []
        if linear_states is not None and hybrid_verify_drafts and verify_rows:
            self.verify_buckets = batch_buckets(verify_rows)
            chain = None
            if hybrid_verify_drafts > 1 and keep_hidden and hasattr(model, "mtp"):  # the head's chain inside
                embed = model.model.embed_tokens.weight  # [vocab, H]
                chain = ChainedDrafts(verify_rows, hybrid_verify_drafts, embed.shape[1], embed.dtype, pad_row, device)
            self.verify = VerifyLayout(verify_rows, hybrid_verify_drafts, device, chain)
            verify_rows = None
        # --speculative mtp on a hybrid: verify steps settle their acceptance on the device, so the next one can
        # be planned ahead of their results (verify_ahead.py)
        self.ahead = None
        if self.verify is not None and keep_hidden and hasattr(model, "mtp"):
            embed = model.model.embed_tokens.weight
            self.ahead = AheadTables(req_to_token.shape[0], embed.shape[1], embed.dtype, pad_row, device)
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.verify_hidden: dict[int, torch.Tensor] = {}
        self.verify_replays = 0  # hybrid verify steps served by a replay (tests check they ran)
        self.buckets = batch_buckets(max_batch, verify_rows)
        self.max_batch = max([self.buckets[-1], *self.verify_buckets])  # the static buffers' width
        self.decode_batch = max_batch  # the widest decode step: admission pacing's measurement runs it
        self.ints = torch.zeros((_NUM_INT_ROWS, self.max_batch), dtype=torch.int64, device=device)
        self.floats = torch.zeros((NUM_FLOAT_ROWS, self.max_batch), dtype=torch.float32, device=device)
        self.seq_lens = torch.ones(self.max_batch, dtype=torch.int32, device=device)  # int32 for the kernel
        # Two of each host buffer: while step k runs, step k + 1 is prepared (and step k - 1's
        # results read); a buffer is rewritten only after the step that used it was collected.
        self.staging_ints = [host_buffer((_NUM_INT_ROWS, self.max_batch), torch.int64, device) for _ in range(2)]
        self.staging_floats = [host_buffer((NUM_FLOAT_ROWS, self.max_batch), torch.float32, device) for _ in range(2)]
        self.staging_seq_lens = [host_buffer(self.max_batch, torch.int32, device, fill=1) for _ in range(2)]
        self.results = [host_buffer(3 * self.max_batch, torch.float64, device) for _ in range(2)]  # 3: chains
        # shared-prefix decode attention (triton_attention.SharedPrefixMetadata): each replay's groups
        self.shared_prefix = shared_prefix and not deterministic
        if self.shared_prefix:
            self.groups = torch.zeros((3, self.max_batch + 1), dtype=torch.int32, device=device)
            self.staging_groups = [host_buffer((3, self.max_batch + 1), torch.int32, device) for _ in range(2)]
        self._parity = 0  # which of the two buffer sets this replay uses
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # --speculative mtp: each graph's final hidden states [bucket, H], which the MTP head's pass reads
        # after the step (engine/execution/mtp_step.py); valid until the next replay
        self.keep_hidden = keep_hidden
        self.hidden: dict[int, torch.Tensor] = {}
        # and the head's pass behind a plain step, one graph per bucket (run_head): replayed eagerly it costs
        # the host 2.6 ms of launches a step (the trained pair of issue 22 on the H100), 3x the step itself
        self.head_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] | None = (
            {} if keep_hidden and hasattr(model, "mtp") else None)
        self.verify_head_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.head_replays = 0
        self.capture_seconds = 0.0
        self.eager_over_replay: float | None = None  # measured at the first capture (admission pacing's price)
        self.replays = 0  # decode steps served by a replay (tests check graphs really ran)
        moe_layers = getattr(model, "moe_layers", None)
        self.routing = (GraphRoutingBuffer(self.max_batch, len(moe_layers), model.top_k, model.num_experts, device)
                        if moe_layers else None)

    def _attention(self, batch: int):
        """The full-attention metadata of a replay of `batch` rows, over the static buffers."""
        positions, rows, slots = (self.ints[i, :batch] for i in (_POSITION, _ROW, _SLOT))
        shared = None
        if self.shared_prefix:  # never in the on-policy mode
            num_groups = group_slots(batch)
            shared = SharedPrefixMetadata(self.groups[_ORDER, :batch], self.groups[_GROUP_STARTS, :num_groups + 1],
                                          self.groups[_PREFIX_LENS, :num_groups])
        return self.row_attention(slots, rows, self.seq_lens[:batch], positions, shared)

    def row_attention(self, slots, rows, seq_lens, positions, shared: SharedPrefixMetadata | None = None):
        """Decode attention of one token per row (slots, req_to_token rows and positions [B] int64, seq_lens [B]
        int32), over device tensors: what a graph captures."""
        if self.deterministic:  # the same kernel as eager steps, so a replayed token equals an eager one
            return invariant_decode_attention(self.kv, self.req_to_token, slots, rows, positions, self.scale)
        return TritonAttentionBatch(self.kv, self.req_to_token, slots, rows, seq_lens, None, self.scale,
                                    shared_prefix=shared)

    def _forward(self, batch: int, verify: bool = False) -> torch.Tensor:
        """One step of `batch` rows over the static buffers -> packed (token ids, logprobs) [2, batch];
        `verify`: a hybrid's verify step, its linear layers reading the VerifyLayout (with MTP's chain: its
        input ids too, [3, batch])."""
        given, positions, rows, slots = (self.ints[i, :batch] for i in (_TOKEN, _POSITION, _ROW, _SLOT))
        ahead = self.ahead if verify else None
        if ahead is not None:  # rows planned ahead of the step before move by what it kept (verify_ahead.py)
            delta = ahead.shift(self.ints[_SHIFTED, :batch], rows, positions, self.ints[_ROPE_POSITION, :batch],
                                self.ints[_SAMPLE_POSITION, :batch], self.seq_lens[:batch], slots, self.req_to_token,
                                self.verify.cu[:batch + 1], self.verify.slots[:batch])
            if self.verify.chain is not None:
                self.verify.chain.shift(batch, delta, self.ints[_SHIFTED, :batch], self.req_to_token,
                                        ahead.next_hidden)
        ids = self.tokens.input_ids(given, rows)  # [batch]
        if ahead is not None:
            ids = ahead.input_ids(ids, rows)
        self.req_to_token[rows, positions] = slots.to(torch.int32)  # this step's slots, inside the graph
        chain = self.verify.chain if verify else None
        if chain is not None:  # MTP's drafts 2.. drawn by the head, into ids, before the target's forward
            ids = chain.draft_inside(self, batch, ids)
        attn = self._attention(batch)
        if self.linear_states is not None:  # hybrid: state slots from the static buffer, filled before each replay
            linear = (self.verify.linear_batch(self.linear_states, batch) if verify else
                      LinearBatch(self.linear_states, self.ints[_STATE_SLOT, :batch], triton_kernels=True))
            attn = HybridBatch(attn, linear)
        hidden = self.model(ids, self.ints[_ROPE_POSITION, :batch], attn)
        if self.keep_hidden:
            (self.verify_hidden if verify else self.hidden)[batch] = hidden
        logits = self.model.compute_logits(hidden, upcast=False)  # [batch, vocab]
        tokens, logprobs = sample_rows(logits, self.ints[_SAMPLING:], self.floats, use_triton=True)
        if ahead is not None:  # each entry's bonus token (not each row's) into the token table, and what it kept
            ahead.settle(self.verify.cu[:batch + 1], rows, ids, tokens, self.verify.slots[:batch],
                         self.verify.forks[:batch], self.tokens)
        else:
            self.tokens.store(rows, tokens)
        # float64 holds the token ids and the float32 logprobs exactly; a verify step's input ids (the drafts
        # drawn on the device) too
        inputs = [ids.double()] if chain is not None or ahead is not None else []
        return torch.stack((tokens.double(), logprobs.double(), *inputs))

    def _head_forward(self, batch: int, packed: torch.Tensor, verify: bool = False) -> torch.Tensor:
        """--speculative mtp: the MTP head's pass behind a plain decode step of `batch` rows, as
        MTPStep.store_kv_on_device runs it eagerly: at each row's position q, (the step's final hidden
        state, the token it sampled at q + 1, packed [2, batch] row 0) -> the head's outputs [batch, H],
        its KV stored at the step's slots (one more layer of the pool). `verify`: behind a hybrid's verify
        step, over every row: at an accepted position the token sampled there is the next token (the next
        draft, or the token drawn after the last accepted one), so the rows up to each entry's last
        accepted one are what the eager pass after the step computes; later rows' KV slots go back."""
        embeds = self.model.model.embed_tokens(packed[0].long())  # [batch, H]
        hidden = (self.verify_hidden if verify else self.hidden)[batch]
        out = self.model.mtp(embeds, hidden, self.ints[_ROPE_POSITION, :batch], self._attention(batch))
        if verify and self.ahead is not None:  # the next draft of each entry, for a step planned ahead
            self.ahead.settle_head(self.verify.cu[:batch + 1], self.ints[_ROW, :batch], out, self.model)
        return out

    def capture(self, warm_up: bool = True) -> None:
        """warm_up=False skips the eager pass over every bucket: for a re-capture after a memory
        release, when the kernels are compiled and cuBLAS is initialised (saves a forward per bucket)."""
        with routing_recorder_swapped(self.model, self.routing):
            self._capture(warm_up)

    @torch.inference_mode()
    def _capture(self, warm_up: bool) -> None:
        start = time.monotonic()
        self.ints[_ROW].fill_(self.pad_row)
        self.floats.copy_(torch.tensor(FLOAT_PADDING)[:, None].expand_as(self.floats))  # greedy, unfiltered
        if warm_up:
            with side_stream(self.device):  # compiles the kernels, initialises cuBLAS, settles the allocator
                for batch in self.buckets:
                    if self.shared_prefix:  # every row alone: one group of prefix 0
                        self.groups.copy_(self._group_rows(None, batch, self.groups.shape[1]))
                    packed = self._forward(batch)
                    if self.head_graphs is not None:
                        self._head_forward(batch, packed)
                if self.verify is not None:
                    self.verify.fill_padding()
                    for batch in self.verify_buckets:
                        if self.shared_prefix:
                            self.groups.copy_(self._group_rows(None, batch, self.groups.shape[1]))
                        packed = self._forward(batch, verify=True)
                        if self.head_graphs is not None:
                            self._head_forward(batch, packed, verify=True)
                # eager mixed steps use split counts no bucket has; q is the model's dtype (the pool's may be e4m3)
                warm_decode_splits(self.kv, self.req_to_token, self.pad_row, self.scale,
                                   self.model.model.embed_tokens.weight.dtype, _attention_heads(self.model),
                                   shared_prefix=self.shared_prefix)
        pool = None
        with garbage_collection_paused():
            for batch in reversed(self.buckets):  # largest first so smaller graphs reuse its pool
                graph, packed = capture(self._as_captured(self._forward, batch), self.device, pool)
                pool = graph.pool()
                self.graphs[batch] = (graph, packed)
                if self.head_graphs is not None:  # the same pool: replayed right behind its decode graph
                    step = self._as_captured(self._head_forward, batch, packed)
                    self.head_graphs[batch] = capture(step, self.device, pool)
            if self.verify is not None:  # filled with padding at warm-up; a re-capture fills it again
                self.verify.fill_padding()
            for batch in reversed(self.verify_buckets):  # the same pool: a step replays one graph or the other
                graph, packed = capture(self._as_captured(self._forward, batch, verify=True), self.device, pool)
                self.verify_graphs[batch] = (graph, packed)
                if self.head_graphs is not None:
                    step = self._as_captured(self._head_forward, batch, packed, verify=True)
                    self.verify_head_graphs[batch] = capture(step, self.device, pool)
        synchronize(self.device)
        if warm_up:  # a re-capture after a memory release keeps the first measurement
            self.eager_over_replay = self._eager_over_replay(self.decode_batch)
        self.capture_seconds = time.monotonic() - start

    def _as_captured(self, step, *args, **kwargs):
        """step(*args, **kwargs) as its graph runs it: MoE layers recording into the graphs' routing buffer. A
        CUDA graph keeps what capture() set up; the CPU's stand-in calls the step again at each replay, outside
        capture(), so the swap is part of the step."""
        def captured():
            with routing_recorder_swapped(self.model, self.routing):
                return step(*args, **kwargs)
        return captured

    def _eager_over_replay(self, batch: int) -> float:
        """A decode step of `batch` (padding) rows run eagerly over the same step replayed, best of 3 each:
        admission pacing's price of an eager step (scheduling/admission_pacing.py)."""
        graph, _ = self.graphs[batch]
        kept = self.hidden.get(batch)  # the eager forward would replace the graph's hidden-state buffer
        eager = best_seconds(lambda: self._forward(batch), self.device)
        if kept is not None:
            self.hidden[batch] = kept
        return eager / best_seconds(graph.replay, self.device)

    def ahead_rows(self) -> int | None:
        """The widest verify step the scheduler may plan ahead of the one in flight (verify_ahead.py), or None where
        verify steps do not settle on the device (no MTP head on a hybrid)."""
        return self.verify_buckets[-1] if self.ahead is not None else None

    def can_run(self, entries, verify: bool = False) -> bool:
        """A decode-only step within the largest bucket (`verify`: a hybrid's verify rows, within the
        verify graphs'); samples that want their positions' top logprobs run eagerly (the graphs copy back
        the sampled token and its logprob only)."""
        widest = (self.verify_buckets or [0])[-1] if verify else self.buckets[-1]
        return 0 < len(entries) <= widest and all(
            e.num_new_tokens == 1 and e.sample and not e.request.params.per_token_extras for e in entries)

    def run(self, entries, verify_entries=None) -> torch.Tensor:
        """Replay for a decode-only step; returns (token ids, logprobs) as float64 [2, len(entries)],
        valid until the next replay. An entry scheduled ahead (token PENDING) decodes its row's token from
        the token table, where the step before stored it. `verify_entries`: a hybrid's verify step, whose
        one-token rows `entries` are (1 + d rows per verify entry, in order); its layout goes up too.

        Padding rows (bucket past the batch) decode token 0 at position 0 in slot 0 and sample greedily."""
        batch = len(entries)
        buckets = self.verify_buckets if verify_entries is not None else self.buckets
        bucket = next(b for b in buckets if b >= batch)
        pad = [0] * (bucket - batch)
        sampling = SamplingRows([e.request for e in entries], [e.start + 1 for e in entries])  # drawn at start + 1
        self._parity ^= 1
        ints, floats, seq_lens = (buffers[self._parity] for buffers in
                                  (self.staging_ints, self.staging_floats, self.staging_seq_lens))
        # Plain lists, then one host copy and one device copy per buffer.
        ints[:, :bucket] = torch.tensor([
            [e.token_ids[0] for e in entries] + pad,  # PENDING passes through: the graph reads the token table
            [e.start for e in entries] + pad,
            [e.table_row for e in entries] + [self.pad_row] * len(pad),
            [e.new_slots[0] for e in entries] + pad,
            [e.request.state_slot for e in entries] + pad,  # padding rows: linear-state slot 0
            [e.start + e.request.rope_delta for e in entries] + pad,
            [int(e.shifted) for e in entries] + pad,  # positions moved on the device (verify_ahead.py)
            *sampling.int_rows(pad=len(pad)),
        ], dtype=torch.int64)
        floats[:, :bucket] = torch.tensor(sampling.float_rows(pad=len(pad)), dtype=torch.float32)
        if self.shared_prefix:
            groups = group_shared_prefixes([e.request for e in entries], max_groups=group_slots(bucket))
            staged = self.staging_groups[self._parity]
            staged[:, :bucket + 1] = self._group_rows(groups, bucket, bucket + 1)
            self.groups.copy_(staged, non_blocking=True)
        seq_lens[:bucket] = torch.tensor([e.start + 1 for e in entries] + [1] * len(pad), dtype=torch.int32)
        # Whole buffers (columns past the bucket are stale and never read): a column slice of a
        # [rows, max_batch] buffer is strided, and torch would stage a strided host-to-device copy
        # through pageable memory, which can make the host wait for the step in flight.
        self.ints.copy_(ints, non_blocking=True)
        self.floats.copy_(floats, non_blocking=True)
        self.seq_lens.copy_(seq_lens, non_blocking=True)
        if verify_entries is not None:
            self.verify.fill(verify_entries, bucket, self._parity)
        graph, packed = (self.verify_graphs if verify_entries is not None else self.graphs)[bucket]
        graph.replay()
        self.replays += 1
        self.verify_replays += verify_entries is not None
        self._last_replay = (packed, batch, self.verify_hidden if verify_entries is not None else self.hidden)
        return packed[:, :batch]

    @staticmethod
    def _group_rows(groups, bucket: int, width: int) -> torch.Tensor:
        """The group buffer's rows [3, width] for a replay of `bucket` rows: `groups` (PrefixGroups, or
        None: every row alone) padded to the bucket's group slots."""
        slots = group_slots(bucket)
        order, starts, prefixes = (groups or PrefixGroups.everyone_alone()).padded(bucket, slots)
        rows = torch.zeros((3, width), dtype=torch.int32)
        rows[_ORDER, :bucket] = torch.tensor(order, dtype=torch.int32)
        rows[_GROUP_STARTS, :slots + 1] = torch.tensor(starts, dtype=torch.int32)
        rows[_PREFIX_LENS, :slots] = torch.tensor(prefixes, dtype=torch.int32)
        return rows

    def last_sampled(self) -> torch.Tensor:
        """The last replay's sampled tokens [batch] int64 on the device, until the next replay."""
        packed, batch, _ = self._last_replay
        return packed[0, :batch].long()

    def last_hidden(self) -> torch.Tensor:
        """The last replay's final hidden states [batch, H] (keep_hidden graphs), until the next replay."""
        packed, batch, hidden = self._last_replay
        return hidden[packed.shape[1]][:batch]

    def run_head(self) -> torch.Tensor:
        """--speculative mtp, after `run` of a plain decode step (or a hybrid's verify step): replay the head's
        graph of its bucket (the head's KV at the step's slots) -> a copy of the head's outputs [batch, H],
        which the next replay would overwrite."""
        packed, batch, hidden = self._last_replay
        graph, out = (self.verify_head_graphs if hidden is self.verify_hidden else self.head_graphs)[packed.shape[1]]
        graph.replay()
        self.head_replays += 1
        return out[:batch].clone()

    def results_to_host(self) -> torch.Tensor:
        """Queue the copy of the last replay's results to pinned memory; returns its [2, batch] view
        there, to read once the stream got past the copy. Both sides are contiguous [2, bucket]
        buffers, so the copy is one asynchronous DMA (a strided copy would stage through the host)."""
        packed, batch, _ = self._last_replay
        host = self.results[self._parity][: packed.numel()].view(packed.shape)
        host.copy_(packed, non_blocking=True)
        return host[:, :batch]

    def routing_rows(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After `run` of `batch` entries: (KV slots [batch], expert ids [batch, num_moe_layers, top_k])."""
        return self.ints[_SLOT, :batch], self.routing.ids[:batch]
