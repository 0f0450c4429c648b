"""Runs one scheduled step: build input tensors, forward, sample.

Owns the device side of the engine: the model, the KV pool, the
req_to_token table ([max_running + 1, max_model_len] slot ids; row r holds
the KV slot of every position of the request in row r; the last row is the
padding row of CUDA-graph batches) and, on CUDA, the decode graphs.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from rollout_cli.engine.execution.attention import KVCache, prepare_attention
from rollout_cli.engine.execution.graph_buckets import verify_graph_rows
from rollout_cli.engine.execution.graph_replay import results_ready_event
from rollout_cli.engine.execution.linear_state import HybridBatch, begin_step, prepare_step
from rollout_cli.engine.execution.mtp_chain import fill_drafts
from rollout_cli.engine.execution.mtp_step import MTPStep
from rollout_cli.engine.execution.on_policy import PoolTokenAttention, token_forward
from rollout_cli.engine.execution.prefix_groups import group_shared_prefixes
from rollout_cli.engine.execution.sampler import SamplingRows, sample_extras, sample_rows, teacher_logprobs
from rollout_cli.engine.execution.token_table import TokenTable
from rollout_cli.engine.execution.verify_layout import graph_rows
from rollout_cli.engine.execution.vision_step import EncoderCache, step_positions_and_images
from rollout_cli.engine.scheduling.schedule_output import PENDING, BatchEntry, ScheduleOutput
from rollout_kernels.host_to_device import to_device


@dataclass
class DecodeTraffic:
    """What decode steps had to read, for the bandwidth-limit report of `rollout bench`."""

    steps: int = 0  # forward steps that decoded at least one request
    tokens: int = 0  # decode tokens produced
    context_tokens: int = 0  # sum over decode steps of the KV positions attended
    # the same, with a prefix several decodes share through the prefix cache counted once per step
    # (what must move from HBM at least: distinct_context_tokens); only with
    # `ModelRunner.count_distinct_context`
    distinct_context_tokens: int = 0
    # With `ModelRunner.time_decode_steps` (CUDA graph steps only): GPU time between the
    # replay and the sampled tokens (CUDA events), and the engine's wall time of those steps.
    timed_steps: int = 0
    gpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    wait_seconds: float = 0.0  # of the wall time, the host blocked on those steps' results
    # Steps that run prompt tokens (prefill chunks, alone or beside decodes): their count and wall time.
    prefill_steps: int = 0
    prefill_wall_seconds: float = 0.0
    prefill_max_seconds: float = 0.0  # the slowest: one far above the mean is a one-time cost (a compile)


def distinct_context_tokens(decodes) -> int:
    """KV positions a decode step must read at least once: every entry's context, the prefix a group of
    samples of one prompt holds in the same slots counted once (prefix_groups: the groups shared-prefix
    decode attention reads once, here down to one shared key)."""
    groups = group_shared_prefixes([e.request for e in decodes], min_prefix=1)
    return sum(e.start + 1 for e in decodes) - (groups.shared_keys if groups is not None else 0)


@dataclass
class StepHandle:
    """A launched step. Eager steps carry their results; graph steps fill `host` ([2, B] float64,
    pinned: token ids, logprobs; [3, B] where MTP chained drafts inside a verify graph: its input ids too)
    behind the `ready` event, read by ModelRunner.collect."""

    out: ScheduleOutput
    tokens: list[int] | None = None
    logprobs: list[float] | None = None
    scores: list[float] = field(default_factory=list)  # scoring requests' teacher-forced logprobs, entry order
    score_tops: list | None = None  # with --top-logprobs: (ids, logprobs) of the k most likely tokens, per score
    sample_extras: list | None = None  # per sampled row: (top list, sampling mask), sampler.sample_extras
    prefilled: bool = False  # the step ran prompt tokens
    graph_step: bool = False  # replayed a decode graph: its sampled tokens are also on the device
    host: torch.Tensor | None = None
    ready: object = None  # torch.cuda.Event recorded after the copy to `host`
    timing: tuple | None = None  # (start, end) timing events around the replay (time_decode_steps)
    launch_time: float = field(default_factory=time.perf_counter)  # when launch() (or the step loop's planning) began


class ModelRunner:
    def __init__(self, model, kv: KVCache, max_running: int, max_model_len: int, device: torch.device,
                 attention_backend: str = "torch", linear_states=None, deterministic: bool = False,
                 shared_prefix_attention: bool = False):
        self.model = model
        self.shared_prefix_attention = shared_prefix_attention and attention_backend == "triton"  # config.py
        self.kv = kv
        self.linear_states = linear_states  # hybrid models: engine.linear_state.LinearStatePool
        self.device = device
        self.pad_row = max_running
        self.req_to_token = torch.zeros((max_running + 1, max_model_len), dtype=torch.int32, device=device)
        self.tokens = TokenTable(max_running + 1, device)  # each row's last sampled token (PENDING inputs)
        head_dim = getattr(model, "attention_head_dim", None)  # hybrid models: layer 0 may be linear attention
        self.scale = (head_dim or model.model.layers[0].self_attn.head_dim) ** -0.5
        self.attention_backend = attention_backend
        self.graphs = None
        self.graphs_dropped = False  # dropped by a memory release, to be re-captured on resume
        self.traffic = DecodeTraffic()
        self.time_decode_steps = False  # `rollout bench` turns this on to measure GPU idle time
        # `rollout bench` turns this on too: the shared-prefix count costs ~0.1 ms of host time per decode
        # step at batch 256, which no other caller reads
        self.count_distinct_context = False
        self.routing_pool = None  # a routing_pool.RoutingPool while routing capture is on (Engine sets it)
        # vision-language models: the vision tower's outputs per image (engine/execution/vision_step.py)
        self.encoder_cache = EncoderCache(model, device) if hasattr(model, "visual") else None
        # --speculative mtp: the head's pass after each step reads the step's hidden states [T, H]
        self.mtp_step = MTPStep(self) if hasattr(model, "mtp") else None
        self.last_hidden = None  # the forward's final hidden states [T, H], for the head's pass
        self._set_mode(deterministic)

    def draft_after_step(self, out: ScheduleOutput, drafting: bool, propose: bool = True) -> None:
        """After `out` was post-processed: the MTP head's KV of its accepted positions (while `drafting`:
        the scheduler has an MTP drafter; `rollout bench` times steps without) and, if `propose` (the
        next step may carry drafts), the next drafts. A plain decode step's pass ran behind it at launch."""
        if self.mtp_step is not None:
            self.mtp_step.after_step(out, drafting, propose)

    def _set_mode(self, deterministic: bool) -> None:
        """On-policy mode or not. In it no row's bits may depend on its batch: the Triton backend gets
        there with batch-invariant kernels (the model's, enable_batch_invariant_kernels; attention,
        prepare_invariant_attention; the sampler's rows are already independent), the torch path by
        running every token in a forward of its own and sampling every row alone (_forward_logits)."""
        self.deterministic = deterministic
        self.per_token = deterministic and self.attention_backend != "triton"
        if self.attention_backend == "triton":
            # Triton: optional on the CPU
            from rollout_cli.engine.execution.triton_attention import (prepare_invariant_attention,
                                                                       prepare_triton_attention)
            plain = functools.partial(prepare_triton_attention, shared_prefix=self.shared_prefix_attention)
            self._prepare = prepare_invariant_attention if deterministic else plain
        else:
            self._prepare = prepare_attention

    def set_deterministic(self, deterministic: bool) -> None:
        """Switch the mode on a loaded runner (Engine.set_deterministic): the decode graphs are captured
        again, since they baked in the other mode's attention kernel."""
        self._set_mode(deterministic)
        if self.graphs is not None:
            self.graphs = None
            self.capture_cuda_graphs(self._graph_max_batch, self._graph_drafts)

    def capture_cuda_graphs(self, max_batch: int, drafts: tuple[int, int | None] = (0, None),
                            warm_up: bool = True) -> float:
        """Capture decode graphs for batches up to max_batch, and with speculation on a model without linear
        layers (drafts: draft tokens per request, the batch up to which steps draft or None) for the verify
        steps' 1 + d rows per request up to MAX_VERIFY_ROWS; returns the capture time in seconds."""
        from rollout_cli.engine.execution.cuda_graphs import DecodeGraphs  # Triton: CPU-optional

        assert self.attention_backend == "triton", "CUDA graphs need the Triton attention backend"
        # hybrids verify on graphs of their own (MTP's chained drafts, K > 1, drawn inside them)
        self.graphs = DecodeGraphs(self.model, self.kv, self.req_to_token, self.tokens, self.pad_row, self.scale,
                                   max_batch, self.linear_states, deterministic=self.deterministic,
                                   keep_hidden=self.mtp_step is not None, shared_prefix=self.shared_prefix_attention,
                                   verify_rows=verify_graph_rows(max_batch, *drafts),
                                   hybrid_verify_drafts=drafts[0])
        self.graphs.capture(warm_up)
        self._graph_max_batch, self._graph_drafts = max_batch, drafts
        self.graphs_dropped = False
        return self.graphs.capture_seconds

    def drop_cuda_graphs(self) -> None:
        """Free the graphs and their memory pool (memory release); recapture_cuda_graphs brings them back."""
        if self.graphs is not None:
            self.graphs = None
            self.graphs_dropped = True

    def recapture_cuda_graphs(self) -> float:
        return self.capture_cuda_graphs(self._graph_max_batch, self._graph_drafts, warm_up=False)

    def _write_table(self, entries) -> None:
        rows, cols, slots = [], [], []
        for e in entries:
            n = len(e.table_slots)
            rows.extend([e.table_row] * n)
            cols.extend(range(e.table_start, e.table_start + n))
            slots.extend(e.table_slots)
        if slots:
            index = (to_device(rows, torch.long, self.device), to_device(cols, torch.long, self.device))
            self.req_to_token.index_put_(index, to_device(slots, torch.int32, self.device))

    def _count_traffic(self, out: ScheduleOutput) -> None:
        decodes = [e for e in out.entries if e.num_new_tokens == 1]
        if decodes:
            self.traffic.steps += 1
            self.traffic.tokens += len(decodes)
            self.traffic.context_tokens += sum(e.start + 1 for e in decodes)
            if self.count_distinct_context:
                self.traffic.distinct_context_tokens += distinct_context_tokens(decodes)

    # ---- one step: launch, then collect ------------------------------------------------------

    def run(self, out: ScheduleOutput) -> tuple[list[int], list[float]]:
        """One step, start to finish: the sampled token and its logprob per sampling entry."""
        return self.collect(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: ScheduleOutput) -> StepHandle:
        """Start one forward over all entries; `collect` returns its sampled tokens.

        A CUDA-graph decode step returns before the GPU is done (its results travel to pinned host
        memory behind it), so the host can plan and launch the next step meanwhile; eager steps
        finish here. Entries scheduled ahead (token PENDING) read their input from the token table,
        where the step before stored it.
        Reorders `out.entries` decodes first (the attention kernels want them so); results follow
        that order, which postprocess then walks.
        """
        started = time.perf_counter()
        out.entries.sort(key=lambda e: e.num_new_tokens > 1)
        self._count_traffic(out)
        prefilled = bool(out.entries) and out.entries[-1].num_new_tokens > 1
        rows = self._graph_rows(out.entries) if self.graphs is not None else None
        if rows is not None:
            return self._launch_graph(out, rows, started=started)
        assert not any(e.shifted for e in out.entries), "a step planned ahead of a verify step runs on its graph"
        tokens, logprobs, scores, tops, extras = self._run_eager(out)
        return StepHandle(out, tokens=tokens, logprobs=logprobs, scores=scores, score_tops=tops, prefilled=prefilled,
                          launch_time=started, sample_extras=extras)

    def collect(self, handle: StepHandle) -> tuple[list[int], list[float]]:
        """The step's (tokens, logprobs), waiting for the GPU if it is still running."""
        if handle.tokens is None:
            waited = time.perf_counter()
            handle.ready.synchronize()
            if handle.timing is not None:
                self.traffic.wait_seconds += time.perf_counter() - waited
            token_values, logprob_values, *chain_ids = handle.host.tolist()
            if chain_ids:  # a verify graph's input ids: MTP's drafts 2.., drawn inside it (mtp_chain.py)
                fill_drafts(handle.out.entries, chain_ids[0])
            handle.tokens, handle.logprobs = [int(t) for t in token_values], logprob_values
            if handle.timing is not None:
                self.traffic.timed_steps += 1
                self.traffic.gpu_seconds += handle.timing[0].elapsed_time(handle.timing[1]) / 1e3
        return handle.tokens, handle.logprobs

    def _run_eager(self, out: ScheduleOutput) -> tuple[list[int], list[float], list[float], list | None, list | None]:
        """(sampled tokens, their logprobs, the scored rows' logprobs, their top-k (ids, logprobs) or None,
        the sampled rows' (top list, sampling mask) or None: sampler.sample_extras)."""
        sampled = [e for e in out.entries if e.sample]
        if self.per_token:  # one token per forward, from host ints
            self.tokens.resolve_on_host(out.entries)
        self._write_table(out.entries)
        if self.mtp_step is not None:  # --speculative mtp: draft positions 2..K, now that their slots exist
            self.mtp_step.extend_drafts(out.entries)
        logits, score_logits = self._forward_logits(out)
        hidden, self.last_hidden = self.last_hidden, None  # --speculative mtp: for the head's pass
        scores, tops = [], None
        if score_logits is not None:
            # the Triton backend scores on the sampler's kernel (kernels/sampling_score.py): a scored
            # token's logprob has the bits the sampler reported when it drew it
            scored = teacher_logprobs(score_logits, [e for e in out.entries if e.score_targets],
                                      per_row=self.per_token, use_triton=self.attention_backend == "triton")
            if isinstance(scored, tuple):  # top-k too: one (ids, logprobs) pair of lists per scored row
                scored, top_ids, top_logprobs = scored
                tops = list(zip(top_ids.tolist(), top_logprobs.tolist()))
            scores = scored.tolist()
        if not sampled:
            out.mtp_hidden = hidden  # None without --speculative mtp
            return [], [], scores, tops, None
        # each row draws the token at the position after its own: that position keys its random number (an
        # entry verifying drafts samples at its last 1 + num_draft rows, engine/scheduling/speculation.py)
        requests = [e.request for e in sampled for _ in range(1 + e.num_draft)]
        positions = [e.start + e.num_new_tokens - e.num_draft + j for e in sampled for j in range(1 + e.num_draft)]
        sampling = SamplingRows(requests, positions)
        tokens, logprobs = sample_rows(logits, *sampling.to_device(self.device),
                                       use_triton=self.attention_backend == "triton", per_row=self.per_token)
        if not any(e.num_draft for e in sampled):  # verify steps keep no token here (token_table.py)
            self.tokens.store(to_device([e.table_row for e in sampled], torch.long, self.device), tokens)
        if hidden is not None:
            self.mtp_step.at_launch(out, hidden, lambda: tokens)
        # one device-to-host copy: float64 holds both the token ids and the float32 logprobs exactly
        token_values, logprob_values = torch.stack((tokens.double(), logprobs.double())).tolist()
        extras = sample_extras(logits, requests, tokens, per_row=self.per_token,
                               use_triton=self.attention_backend == "triton")
        return [int(t) for t in token_values], logprob_values, scores, tops, extras

    def _graph_rows(self, entries) -> list | None:
        return graph_rows(entries, self.graphs, hybrid=self.linear_states is not None)

    def _launch_graph(self, out: ScheduleOutput, rows: list, started: float) -> StepHandle:
        """A decode-only step by graph replay (forward and sampling) of its one-token `rows`, all sampling."""
        # the graph writes each entry's new slot into req_to_token; older slots that a
        # prefix-cache merge changed (table_start < start) are written here first
        # (a shifted entry's: every slot it may use, read back on the device at the positions it moves to)
        self._write_table([e for e in out.entries if e.table_start < e.start or e.shifted])
        if self.linear_states is not None:  # state copies and zeroing stay outside the graph
            prepare_step(self.linear_states, out)
        timing = None
        if self.time_decode_steps and self.device.type == "cuda":  # the GPU's time (rollout bench)
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record()
        hybrid_verify = self.linear_states is not None and any(e.num_draft or e.shifted for e in out.entries)
        self.graphs.run(rows, out.entries if hybrid_verify else None)
        out.settled_on_device = hybrid_verify and self.graphs.ahead is not None  # a next step may be planned ahead
        if self.routing_pool is not None:  # the graph recorded this step's ids; eager steps record directly
            self.routing_pool.store(*self.graphs.routing_rows(len(rows)))
        if timing is not None:
            timing[1].record()
        # Copied out before the next replay can overwrite the graph's output (graphs share one pool).
        host = self.graphs.results_to_host()
        ready = results_ready_event(self.device)
        if self.mtp_step is not None:  # behind the results' copy: collecting them need not wait for it
            self.mtp_step.at_launch(out, self.graphs.last_hidden(), self.graphs.last_sampled,
                                    self.graphs.run_head if self.graphs.head_graphs is not None else None)
        return StepHandle(out, host=host, ready=ready, timing=timing, graph_step=True, launch_time=started)

    def _forward_logits(self, out: ScheduleOutput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's forward: logits [B, V] of its sampling entries' last rows and [S, V] of its scored
        rows, in entry order (each None when there are none)."""
        if not self.per_token:
            return self._eager_logits(out)
        # One token per forward, in order: each token's every reduction (matmul, attention over its
        # exact context, norms, softmax) has the same shape and inputs whether it came in a prefill
        # chunk, a decode step, a batch of one or of 256, so its bits cannot depend on them.
        if self.linear_states is not None:
            self.linear_states.copy(out.state_copies)  # once, before any token; each sub-step zeroes its own start
        sample_rows, score_rows = [], []
        hidden_rows = [] if self.mtp_step is not None else None  # [1, H] per token, for the MTP head's pass
        for e in out.entries:
            for j, token in enumerate(e.token_ids):
                sample = e.sample and j >= e.num_new_tokens - 1 - e.num_draft
                scored = e.score_targets is not None and 0 <= j - e.score_first_row < len(e.score_targets)
                logits = self._token_forward(e, j, token, keep_logits=sample or scored, hidden_rows=hidden_rows)
                if e.state_forks is not None and j < e.num_draft:  # the state after draft position j kept
                    self.linear_states.copy([(e.request.state_slot, e.state_forks[j])])
                if sample:
                    sample_rows.append(logits)
                if scored:
                    score_rows.append(logits)
        if hidden_rows:
            self.last_hidden = torch.cat(hidden_rows)  # [T, H] in the step's row order
        return (torch.cat(sample_rows) if sample_rows else None), (torch.cat(score_rows) if score_rows else None)

    def _token_forward(self, entry, j: int, token: int, keep_logits: bool,
                       hidden_rows: list | None = None) -> torch.Tensor | None:
        """The on-policy mode's forward of token j of `entry` alone -> its logits [1, V] float32 (if kept);
        its final hidden state appended to hidden_rows (if given)."""
        position, slot = entry.start + j, entry.new_slots[j]
        if self.routing_pool is not None:
            self.routing_pool.begin_step(torch.tensor([slot], dtype=torch.long, device=self.device))
        context = self.req_to_token[entry.table_row, : position + 1].long()  # [position + 1] slots, own included
        attn = PoolTokenAttention(self.kv, slot, context, self.scale)
        one = BatchEntry(entry.request, entry.table_row, position, [token], position, [slot], sample=False)
        if self.linear_states is not None:
            attn = HybridBatch(attn, begin_step(self.linear_states, ScheduleOutput([one]), self.device))
        if self.encoder_cache is None:
            return token_forward(self.model, token, position, attn, self.device, logits=keep_logits,
                                 hidden_rows=hidden_rows)
        rope, vision = step_positions_and_images([one], self.encoder_cache, self.device)  # an image token's row
        return token_forward(self.model, token, rope, attn, self.device, logits=keep_logits, vision=vision,
                             hidden_rows=hidden_rows)

    def _eager_logits(self, out: ScheduleOutput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One forward over the step's entries -> (sampling logits [B, V], scored rows' logits [S, V])."""
        # index lists go up without a host wait (rollout_kernels.host_to_device)
        input_ids = to_device([t for e in out.entries for t in e.token_ids], torch.long, self.device)
        if any(e.token_ids == [PENDING] for e in out.entries):  # scheduled ahead: inputs from the token table
            rows = to_device([e.table_row for e in out.entries for _ in e.token_ids], torch.long, self.device)
            input_ids = self.tokens.input_ids(input_ids, rows)
        vision = None
        if self.encoder_cache is None:
            positions = to_device([p for e in out.entries for p in range(e.start, e.start + e.num_new_tokens)],
                                  torch.long, self.device)
        else:  # multimodal positions; image rows and their embeddings (the vision tower runs here when needed)
            positions, vision = step_positions_and_images(out.entries, self.encoder_cache, self.device)
        # [T] KV slot of every new token: the attention stores k/v there, routing capture its expert ids
        store_slots = to_device([s for e in out.entries for s in e.new_slots], torch.long, self.device)
        if self.routing_pool is not None:
            self.routing_pool.begin_step(store_slots)
        attn = self._prepare(out.entries, self.req_to_token, self.kv, self.scale, store_slots)
        if self.linear_states is not None:
            # the Triton backend (CUDA, or the interpreter on the CPU) runs the Triton recurrences; torch the references
            triton_kernels = self.attention_backend == "triton"
            attn = HybridBatch(attn, begin_step(self.linear_states, out, self.device, triton_kernels,
                                                invariant=triton_kernels and self.deterministic))
        if vision is None:
            hidden = self.model(input_ids, positions, attn)  # [T, hidden]
        else:
            hidden = self.model(input_ids, positions, attn, vision=vision)
        if self.mtp_step is not None:
            self.last_hidden = hidden
        last_rows, score_rows, offset = [], [], 0
        for e in out.entries:
            if e.score_targets:
                first = offset + e.score_first_row
                score_rows.extend(range(first, first + len(e.score_targets)))
            offset += e.num_new_tokens
            if e.sample:  # the last row, or the last 1 + num_draft rows of an entry verifying drafts
                last_rows.extend(range(offset - 1 - e.num_draft, offset))
        if not last_rows and not score_rows:
            return None, None
        # the Triton sampler takes model-dtype logits (it upcasts in registers); the torch one float32
        logits = self.model.compute_logits(hidden[to_device(last_rows + score_rows, torch.long, self.device)],
                                           upcast=self.attention_backend != "triton")  # [B + S, V]
        n = len(last_rows)
        return (logits[:n] if n else None), (logits[n:] if score_rows else None)
