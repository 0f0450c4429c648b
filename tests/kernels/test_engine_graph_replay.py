"""The decode-graph path on the CPU: DecodeGraphs under Triton's interpreter, each graph replaced by
graph_replay.CallReplay (which re-runs the captured step into its static output). The static buffers, bucket
padding, PENDING tokens read from the token table, verify graphs wider than the batch and the MTP head's
graph run as on a GPU, and sample what eager steps do. CUDA's own capture is tested on the GPU
(tests/e2e/test_gpu_engine.py, test_gpu_hybrid.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from backends import interpreter_only
from rollout_cli import Engine, PromptInput, SamplingParams
import rollout_cli.engine.execution.triton_attention as triton_attention
from rollout_cli.engine.execution.cuda_graphs import DecodeGraphs
from rollout_cli.engine.execution.graph_replay import CallReplay
from rollout_cli.engine.execution.mtp_step import MTPStep
from rollout_cli.engine.scheduling.mtp_drafts import RecordingMTPDrafter
from rollout_cli.engine.scheduling.scheduler import Scheduler
from speculative_oracle import OracleDrafter

pytestmark = [interpreter_only]


@pytest.fixture(autouse=True)
def few_kv_splits(monkeypatch):
    """Decode attention in 1 to 4 KV splits (a GPU wants up to 16 for small batches): each split is a program
    the interpreter runs in Python, most of these tests' time."""
    monkeypatch.setattr(triton_attention, "TARGET_DECODE_PROGRAMS", 8)


def _prompts(count: int, seed: int, vocab: int = 300) -> list[PromptInput]:
    rng = random.Random(seed)
    return [PromptInput(i, [rng.randrange(vocab) for _ in range(rng.randint(3, 16))]) for i in range(count)]


def _engine(model_dir, graphs: bool, **options) -> Engine:
    """A float32 CPU engine on the Triton kernels; `graphs`: decode (and verify) steps replay CallReplays."""
    options.setdefault("max_running", 4)  # buckets 1, 2, 4: few forwards to capture under the interpreter
    engine = Engine(model_dir, device="cpu", dtype="float32", attention_backend="triton", max_model_len=64,
                    **options)
    if graphs:
        engine.capture_decode_graphs()
        assert all(isinstance(graph, CallReplay) for graph, _ in engine.runner.graphs.graphs.values())
    return engine


def _samples(engine: Engine, prompts, params) -> list:
    return sorted(engine.stream(prompts, params), key=lambda t: (t.prompt_index, t.sample_index))


def _assert_same(got, want) -> None:
    assert [t.response_token_ids for t in got] == [t.response_token_ids for t in want]
    for a, b in zip(got, want, strict=True):
        assert max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs, strict=True)) < 1e-4


def _verified_drafts(monkeypatch) -> list:
    """Every verify entry's drafts as post-processing compares them: ((prompt, sample, position), drafts) pairs."""
    verified, real = [], Scheduler.postprocess

    def record(self, out, *args, **kwargs):
        verified.extend(((e.request.prompt_index, e.request.sample_index, e.start), tuple(e.token_ids[1:]))
                        for e in out.entries if e.num_draft)
        return real(self, out, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "postprocess", record)
    return verified


def _same_drafts(a: dict, b: dict) -> int:
    """The positions where both runs verified drafts, the drafts both drew there equal (a verify step planned ahead
    of the one in flight may carry fewer near max_new_tokens: it plans for that step keeping every draft)."""
    shared = a.keys() & b.keys()
    for key in shared:
        both = min(len(a[key]), len(b[key]))
        assert a[key][:both] == b[key][:both], (key, a[key], b[key])
    return len(shared)


def test_replayed_decode_steps_sample_what_eager_steps_do(sampling_checkpoint):
    """Seeded sampling at temperature 1 over 6 prompts x n 2 at 4 running: admissions mid-run, steps of 1 to 4
    rows in buckets of 1, 2 and 4 (padding rows), overlapped steps reading their PENDING inputs."""
    prompts = _prompts(6, seed=3)
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_new_tokens=10, ignore_eos=True)
    want = _samples(_engine(sampling_checkpoint, graphs=False), prompts, params)
    engine = _engine(sampling_checkpoint, graphs=True)
    assert engine.runner.graphs.buckets == [1, 2, 4]
    _assert_same(_samples(engine, prompts, params), want)
    assert engine.runner.graphs.replays > 10


def test_moe_graphs_record_the_routing_eager_steps_record(tiny_moe_checkpoints):
    """A MoE model's graphs record each replay's expert ids into their static routing buffer, which the runner
    stores in the routing pool (routing capture on): every trajectory's routing equals the eager engine's, one
    row per token that was an input."""
    prompts = _prompts(6, seed=7)
    params = SamplingParams(n=1, temperature=1.0, seed=5, max_new_tokens=8, ignore_eos=True)
    runs = []
    for graphs in (False, True):
        engine = _engine(tiny_moe_checkpoints["qwen3_moe"], graphs=graphs)
        engine.enable_routing_capture()
        runs.append(_samples(engine, prompts, params))
    assert engine.runner.graphs.routing is not None and engine.runner.graphs.replays > 5
    _assert_same(runs[1], runs[0])
    for replayed, eager in zip(*runs, strict=True):
        assert replayed.routed_experts.shape[0] == len(eager.prompt_token_ids) + len(eager.response_token_ids) - 1
        assert np.array_equal(replayed.routed_experts, eager.routed_experts)


def test_verify_steps_wider_than_the_batch_replay_verify_graphs(sampling_checkpoint):
    """--speculative on a dense model: verify steps' 1 + d rows per request (4 running x 5 = 20 rows, past the
    decode batch of 4) replay graphs of their own; greedy tokens of plain decoding, drafts right and wrong
    (the oracle's third draft is wrong)."""
    prompts = _prompts(6, seed=4)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, ignore_eos=True)
    want = _samples(_engine(sampling_checkpoint, graphs=False), prompts, params)
    truth = {(t.prompt_index, t.sample_index): t.response_token_ids for t in want}
    engine = _engine(sampling_checkpoint, graphs=True, speculative="siblings", num_draft_tokens=4,
                     speculative_gate=False)
    graphs = engine.runner.graphs
    assert graphs.buckets[-1] == 20 and graphs.decode_batch == 4 and engine.scheduler.pacing.cost >= 2
    engine.scheduler.enable_speculation(OracleDrafter(truth, lambda k: k == 2), 4)
    _assert_same(_samples(engine, prompts, params), want)
    stats = engine.scheduler.stats
    assert stats.verify_steps > 0 and 0 < stats.accepted_draft_tokens < stats.draft_tokens
    assert graphs.replays >= stats.verify_steps // 4  # every step of up to 4 verifying requests


def test_mtp_heads_graph_computes_what_its_eager_pass_does(mtp_checkpoint, monkeypatch):
    """--speculative mtp --speculative-max-batch 2 at 4 running: steps of 3 or 4 requests decode without drafts
    on the graphs, the head's pass behind each a graph of its own (it reads the decode graph's hidden states and
    sampled tokens); smaller steps verify drafts on verify graphs. Behind every plain replay the head's graph
    gives what its eager pass gives on the same step; against the same engine without graphs, the same tokens,
    and the same drafts where both drafted."""
    real, gaps = MTPStep.at_launch, []

    def checked(self, out, hidden, tokens, head_graph=None):
        def graph_then_eager():
            from_graph = head_graph()  # [B, H]
            gaps.append((from_graph - self.store_kv_on_device(out.entries, hidden, tokens())).abs().max().item())
            return from_graph
        # verify steps (and those planned ahead of one, drafts or not: verify_ahead.py) replay a graph too
        plain = head_graph is not None and not any(e.num_draft or e.shifted for e in out.entries)
        return real(self, out, hidden, tokens, graph_then_eager if plain else head_graph)

    monkeypatch.setattr(MTPStep, "at_launch", checked)
    verified = _verified_drafts(monkeypatch)
    prompts = [PromptInput(p.prompt_index, p.prompt_token_ids, params=SamplingParams(
        n=2, max_new_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True)) for i, p in enumerate(_prompts(4, seed=6))]
    runs, drafts = [], []
    for graphs in (False, True):  # 8 requests at 4 running, down to 2
        engine = _engine(mtp_checkpoint, graphs=graphs, speculative="mtp", num_draft_tokens=2,
                         speculative_max_batch=2, speculative_gate=False)
        verified.clear()
        runs.append(_samples(engine, prompts, SamplingParams()))
        drafts.append(dict(verified))
    _assert_same(runs[1], runs[0])
    assert _same_drafts(*drafts) >= 5  # overlapped graph steps draft at other times than eager steps
    graphs = engine.runner.graphs
    assert graphs.head_replays >= len(gaps) >= 5 and max(gaps) < 1e-4, gaps  # attention split other ways
    assert engine.scheduler.stats.verify_steps > 0


def test_hybrid_verify_steps_replay_verify_graphs(tiny_hybrid_checkpoints):
    """A hybrid engine built with --speculative captures verify graphs of its own, whose linear layers read each
    step's layout (cu, state slots, forks) from static buffers (engine/execution/verify_layout.py): 4 running x
    1 + 4 drafts, entries with fewer drafts and padding rows included; the greedy tokens and logprobs of plain
    decoding, drafts right and wrong."""
    prompts = [PromptInput(p.prompt_index, p.prompt_token_ids, params=SamplingParams(
        n=2, max_new_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True)) for i, p in enumerate(_prompts(3, seed=9))]
    model_dir = tiny_hybrid_checkpoints["qwen3_next"]
    want = _samples(_engine(model_dir, graphs=False), prompts, SamplingParams())
    truth = {(t.prompt_index, t.sample_index): t.response_token_ids for t in want}
    engine = _engine(model_dir, graphs=True, speculative="siblings", num_draft_tokens=4, speculative_gate=False)
    graphs = engine.runner.graphs
    assert graphs.verify_buckets[-1] == 20 and graphs.buckets == [1, 2, 4]
    rng = random.Random(2)
    engine.scheduler.enable_speculation(OracleDrafter(truth, lambda k: rng.random() < 0.3), 4)
    _assert_same(_samples(engine, prompts, SamplingParams()), want)
    stats = engine.scheduler.stats
    assert 0 < stats.accepted_draft_tokens < stats.draft_tokens
    assert graphs.verify_replays >= stats.verify_steps // 4  # most verify steps replayed


def test_mtp_verify_steps_and_the_heads_pass_behind_them_replay_graphs(mtp_checkpoint, monkeypatch):
    """--speculative mtp with one draft token on the hybrid MTP fixture: verify steps replay verify graphs and
    the head's pass behind each replays a graph over every row, the next drafts read from each entry's last
    accepted row (MTPStep.drafts_from). The tokens of the same engine without graphs, and the same drafts
    where both drafted."""
    prompts = [PromptInput(p.prompt_index, p.prompt_token_ids, params=SamplingParams(
        n=2, max_new_tokens=5 + 3 * i, temperature=0.0, ignore_eos=True)) for i, p in enumerate(_prompts(3, seed=5))]
    real, behind_verify = DecodeGraphs.run_head, []

    def run_head(self):
        behind_verify.append(self._last_replay[2] is self.verify_hidden)  # after a verify graph's replay
        return real(self)

    monkeypatch.setattr(DecodeGraphs, "run_head", run_head)
    runs, logs = [], []
    for graphs in (False, True):
        engine = _engine(mtp_checkpoint, graphs=graphs, speculative="mtp", num_draft_tokens=1,
                         speculative_gate=False)
        logs.append({})
        engine.scheduler.enable_speculation(RecordingMTPDrafter(logs[-1]), 1)
        runs.append(_samples(engine, prompts, SamplingParams()))
    _assert_same(runs[1], runs[0])
    shared = logs[0].keys() & logs[1].keys()
    assert len(shared) >= 10 and all(logs[0][k] == logs[1][k] for k in shared)
    assert engine.runner.graphs.verify_replays >= sum(behind_verify) >= 5


def test_mtp_chains_its_drafts_inside_the_verify_graphs(mtp_checkpoint, monkeypatch):
    """--speculative mtp with three draft tokens: the head's chain (drafts 2 and 3) runs inside the verify graph
    before the target's forward (engine/execution/mtp_chain.py) and the step hands its drafts back with its
    tokens. Against the same engine without graphs (the chain drawn eagerly, MTPStep.extend_drafts): the same
    tokens, and every draft chain proposed where both verified the same position equal."""
    chains = []
    real = MTPStep.extend_drafts

    def spy(self, entries):  # the eager chain: what it drew, per (prompt, sample, position)
        real(self, entries)
        chains.extend(((e.request.prompt_index, e.request.sample_index, e.start), tuple(e.token_ids[1:]))
                      for e in entries if e.num_draft > 1)

    monkeypatch.setattr(MTPStep, "extend_drafts", spy)
    verified = _verified_drafts(monkeypatch)
    prompts = [PromptInput(p.prompt_index, p.prompt_token_ids, params=SamplingParams(
        n=2, max_new_tokens=5 + 3 * i, temperature=0.0, ignore_eos=True)) for i, p in enumerate(_prompts(3, seed=5))]
    runs, drafts = [], []
    for graphs in (False, True):
        engine = _engine(mtp_checkpoint, graphs=graphs, speculative="mtp", num_draft_tokens=3,
                         speculative_gate=False)
        verified.clear()
        runs.append(_samples(engine, prompts, SamplingParams()))
        drafts.append(dict(verified))
    _assert_same(runs[1], runs[0])
    assert chains and all(min(d) >= 0 for d in drafts[1].values())  # every DRAFT_LATER and DRAFT_AHEAD filled in
    assert _same_drafts(*drafts) >= 10
    graphs = engine.runner.graphs
    assert graphs.verify.chain is not None and graphs.verify_replays >= 5
