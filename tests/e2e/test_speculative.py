"""Speculative decoding changes no token (issue 22): drafts verified so that every response is the one
decoding without them gives, on the CPU in float32 (tokens equal, logprobs to 1e-4).

An oracle drafter proposes the true continuation (from a run without speculation), corrupted where a case
says: all accepted, the first draft rejected, the last one, random ones; responses that end (length, eos)
inside a draft. Then the sibling drafter end to end (n samples, dense and MoE, routing capture), and the
refusals.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout_cli import Engine, SamplingParams
from rollout_cli.config import EngineConfig
from rollout_cli.engine.execution.cuda_graphs import DecodeGraphs
from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.errors import RolloutError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from speculative_oracle import OracleDrafter  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 250, 31, 8, 9], [7, 7, 8, 100, 42, 11, 12, 200, 13], [300, 2, 4]]


def _run(model: str, params: SamplingParams, drafter=None, prompts=PROMPTS, **options):
    if options.get("speculative"):
        options.setdefault("speculative_gate", False)  # every decode step drafts: tests count the drafts
    engine = Engine(model, device="cpu", dtype="float32", max_model_len=256, kv_cache_tokens=4096, **options)
    if drafter is not None:
        engine.scheduler.enable_speculation(drafter, 5)
    results = sorted(engine.stream([PromptInput(i, p) for i, p in enumerate(prompts)], params),
                     key=lambda t: (t.prompt_index, t.sample_index))
    return engine, results


def _assert_same(got, want) -> None:
    assert [(r.prompt_index, r.sample_index) for r in got] == [(r.prompt_index, r.sample_index) for r in want]
    for a, b in zip(got, want):
        assert a.response_token_ids == b.response_token_ids, (a.prompt_index, a.sample_index)
        assert a.finish_reason == b.finish_reason
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-4)


CORRUPTIONS = {
    "exact": lambda k: False,  # every draft accepted
    "first": lambda k: k == 0,  # rejected at the first position: one token a step, as without drafts
    "last": lambda k: k == 4,  # the last of five rejected
    "random": lambda k, rng=random.Random(0): rng.random() < 0.3,
}
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=23, ignore_eos=True, n=2),
    "seeded": SamplingParams(temperature=1.0, max_new_tokens=23, ignore_eos=True, n=2, seed=5),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
@pytest.mark.parametrize("sampling", sorted(PARAMS))
@pytest.mark.parametrize("arch", ["example", "qwen3_moe", "qwen3_next"])
def test_verified_drafts_give_the_tokens_of_plain_decoding(arch, sampling, corruption, example_model_dir,
                                                           tiny_moe_checkpoints, tiny_hybrid_checkpoints):
    """qwen3_next: a hybrid model, whose linear layers must end each verify step in the state after the
    last accepted token (kept per draft position in fork slots, engine/execution/linear_state.LinearBatch)."""
    model = {"example": example_model_dir, "qwen3_moe": tiny_moe_checkpoints.get("qwen3_moe"),
             "qwen3_next": tiny_hybrid_checkpoints.get("qwen3_next")}[arch]
    params = PARAMS[sampling]
    _, want = _run(model, params)
    truth = {(r.prompt_index, r.sample_index): r.response_token_ids for r in want}
    drafter = OracleDrafter(truth, CORRUPTIONS[corruption])
    engine, got = _run(model, params, drafter)
    _assert_same(got, want)
    stats = engine.scheduler.stats
    assert drafter.proposed == stats.draft_tokens > 0
    if corruption == "exact":  # 23 tokens in steps of up to 6: the first token, then 4 verify steps
        assert stats.accepted_draft_tokens == stats.draft_tokens
    if corruption == "first":
        assert stats.accepted_draft_tokens == 0
    if corruption in ("last", "random"):  # some accepted, some not
        assert 0 < stats.accepted_draft_tokens < stats.draft_tokens
    if arch == "qwen3_next":  # every fork slot back: only the padding slot and the (unused) snapshots held
        linear = engine.scheduler.linear
        assert linear.allocator.num_free == linear.num_slots - 1 - len(linear.snapshots)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_models_verify_drafts_in_the_on_policy_mode_bit_for_bit(arch, tiny_hybrid_checkpoints):
    """--deterministic (the torch path's one-token forwards) on hybrid models: each draft position's state
    kept after its own forward; tokens and logprobs those of plain decoding, to the bit."""
    model = tiny_hybrid_checkpoints[arch]
    params = PARAMS["seeded"]
    _, want = _run(model, params, deterministic=True)
    truth = {(r.prompt_index, r.sample_index): r.response_token_ids for r in want}
    engine, got = _run(model, params, OracleDrafter(truth, CORRUPTIONS["random"]), deterministic=True)
    _assert_same(got, want)
    assert [r.response_logprobs for r in got] == [r.response_logprobs for r in want]
    assert 0 < engine.scheduler.stats.accepted_draft_tokens < engine.scheduler.stats.draft_tokens


def test_hybrid_drafts_need_free_state_slots(tiny_hybrid_checkpoints):
    """Without a free state slot for every draft position a request decodes without drafts (a prompt
    snapshot is never evicted for them): same tokens, fewer drafts."""
    model = tiny_hybrid_checkpoints["qwen3_next"]
    params = PARAMS["greedy"]
    _, want = _run(model, params)
    truth = {(r.prompt_index, r.sample_index): r.response_token_ids for r in want}
    drafted = []
    for spare in (None, 16):  # 16 free slots: 6 running requests, 3 prompt snapshots, forks for one draft
        engine = Engine(model, device="cpu", dtype="float32", max_model_len=256, kv_cache_tokens=4096)
        engine.scheduler.enable_speculation(OracleDrafter(truth, CORRUPTIONS["exact"]), 5)
        allocator = engine.scheduler.linear.allocator
        if spare is not None:
            allocator.allocate(allocator.num_free - spare)
        got = sorted(engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], params),
                     key=lambda t: (t.prompt_index, t.sample_index))
        _assert_same(got, want)
        drafted.append(engine.scheduler.stats.draft_tokens)
    assert 0 < drafted[1] < drafted[0]


def test_the_on_policy_one_token_forwards_verify_drafts_too(example_model_dir):
    """--deterministic on the torch path runs each draft position in a forward of its own: same tokens."""
    params = PARAMS["seeded"]
    _, want = _run(example_model_dir, params, deterministic=True)
    truth = {(r.prompt_index, r.sample_index): r.response_token_ids for r in want}
    engine, got = _run(example_model_dir, params, OracleDrafter(truth, CORRUPTIONS["last"]), deterministic=True)
    _assert_same(got, want)
    assert [r.response_logprobs for r in got] == [r.response_logprobs for r in want]  # bit for bit
    assert engine.scheduler.stats.accepted_draft_tokens > 0


@pytest.mark.parametrize("ending", ["length", "eos"])
def test_a_response_that_ends_inside_a_draft(ending, example_model_dir, with_eos):
    """The draft runs past the end: by max_new_tokens, or by an eos token the response samples mid-draft."""
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    _, plain = _run(example_model_dir, params)
    model, limit = example_model_dir, 11
    if ending == "eos":  # make a token of the middle of the first response the end of the sequence
        model = with_eos(example_model_dir, plain[0].response_token_ids[9])
        params = SamplingParams(temperature=0.0, max_new_tokens=30)
    else:
        params = SamplingParams(temperature=0.0, max_new_tokens=limit, ignore_eos=True)
    _, want = _run(model, params)
    assert ending != "eos" or (want[0].finish_reason == "stop" and len(want[0].response_token_ids) <= 10)
    long = {(r.prompt_index, r.sample_index): r.response_token_ids + [7] * 10 for r in plain}
    _, got = _run(model, params, OracleDrafter(long, lambda k: False))
    _assert_same(got, want)
    assert ending != "length" or all(len(r.response_token_ids) == limit for r in got)


@pytest.mark.parametrize("arch", ["example", "qwen3_next"])
def test_siblings_draft_for_later_samples_and_change_no_token(arch, example_model_dir, tiny_hybrid_checkpoints):
    """Greedy samples of a prompt repeat each other: with two running at a time, the later ones verify the
    earlier ones' responses as drafts (acceptance > 1) and give the same tokens as without."""
    model = example_model_dir if arch == "example" else tiny_hybrid_checkpoints[arch]
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True, n=4)
    _, want = _run(model, params, max_running=2)
    engine, got = _run(model, params, max_running=2, speculative="siblings", num_draft_tokens=4)
    if arch == "qwen3_next":  # the state pool sized for 2 requests, their prompt snapshots and 4 drafts each
        assert engine.linear_states.num_slots == (2 + 4) * 2 + 1
    _assert_same(got, want)
    assert engine.scheduler.stats.acceptance_length > 1.5
    assert len(engine.scheduler.drafter) == 0  # every prompt's group is dropped once its samples ended


def test_the_speculation_gate_sees_every_decode_step_and_changes_no_token(example_model_dir):
    """The default --speculative: the gate (engine/scheduling/draft_gate.py) is told each decode-only step's
    batch, kind, tokens gained and wall time; it measures plain steps first, then drafting ones, and
    whatever it then picks (timing decides, so nothing below depends on it), the tokens are plain decoding's."""
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True, n=4)
    _, want = _run(example_model_dir, params, max_running=2)
    engine = Engine(example_model_dir, device="cpu", dtype="float32", max_model_len=256, kv_cache_tokens=4096,
                    max_running=2, speculative="siblings", num_draft_tokens=4)
    gate, reports = engine.scheduler.draft_gate, []
    record = gate.record
    gate.record = lambda *step: reports.append(step) or record(*step)
    got = sorted(engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], params),
                 key=lambda t: (t.prompt_index, t.sample_index))
    _assert_same(got, want)
    # two plain steps measured (the first a warm-up), then drafting; one step late: the third was planned
    # ahead (overlap scheduling) while the second ran, before the second's report
    assert [drafted for _, drafted, _, _ in reports[:4]] == [False, False, False, True]
    assert all(batch <= 2 and seconds > 0 for batch, _, _, seconds in reports)
    assert all(tokens <= batch for batch, drafted, tokens, _ in reports if not drafted)
    drafting = [(batch, tokens) for batch, drafted, tokens, _ in reports if drafted]
    stats = engine.scheduler.stats
    assert stats.gate_drafting_steps == len(drafting) and stats.gate_plain_steps == len(reports) - len(drafting)  # tokens reported by drafting steps: one per request plus the accepted drafts
    assert sum(tokens - batch for batch, tokens in drafting) <= stats.accepted_draft_tokens


def test_the_gate_weighs_the_time_drafts_take_to_propose(example_model_dir, monkeypatch):
    """A drafting step's wall time counts its planning, where the drafts are proposed: the host's share of
    speculation (a sibling index per request in Python). It was left out (timed from the launch), and the
    gate kept drafting where the whole run measured 0.38x plain decoding (siblings, H100, session 35).
    A clock that moves only while a draft is proposed: every drafting step reports that time."""
    clock = [0.0]

    def perf_counter() -> float:
        clock[0] += 1e-6  # any other step of the loop: a microsecond
        return clock[0]

    monkeypatch.setattr("time.perf_counter", perf_counter)
    engine = Engine(example_model_dir, device="cpu", dtype="float32", max_model_len=256, kv_cache_tokens=4096,
                    max_running=2, speculative="siblings", num_draft_tokens=4)
    drafter, proposals = engine.scheduler.drafter, []
    propose = drafter.propose

    def slow_propose(request, max_tokens):
        clock[0] += 1.0
        proposals.append(request.request_id)
        return propose(request, max_tokens)

    drafter.propose = slow_propose
    gate, reports = engine.scheduler.draft_gate, []
    record = gate.record
    gate.record = lambda *step: reports.append(step) or record(*step)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, n=4)
    list(engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], params))
    drafting = [seconds for _, drafted, _, seconds in reports if drafted]
    plain = [seconds for _, drafted, _, seconds in reports if not drafted]
    assert proposals and drafting and plain
    assert all(seconds >= 1.0 for seconds in drafting)  # at least one proposal each (every running request is asked)
    assert all(seconds < 1.0 for seconds in plain)


def test_routing_capture_records_the_accepted_tokens_only(tiny_moe_checkpoints):
    model = tiny_moe_checkpoints["qwen3_moe"]
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True, n=2)
    runs = []
    for drafter in (None, "oracle"):
        engine = Engine(model, device="cpu", dtype="float32", max_model_len=256, kv_cache_tokens=4096)
        engine.enable_routing_capture()
        if drafter is not None:
            truth = {(r.prompt_index, r.sample_index): r.response_token_ids for r in runs[0]}
            engine.scheduler.enable_speculation(OracleDrafter(truth, CORRUPTIONS["random"]), 5)
        runs.append(sorted(engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], params),
                           key=lambda t: (t.prompt_index, t.sample_index)))
    for a, b in zip(*runs):
        assert a.response_token_ids == b.response_token_ids
        assert a.routed_experts.shape == b.routed_experts.shape and (a.routed_experts == b.routed_experts).all()
    assert engine.scheduler.stats.draft_tokens > 0


def _rows_graphs_would_replay(runner, entries):
    """ModelRunner._graph_rows with stand-in decode graphs of up to 256 rows and no verify graphs (the CPU
    captures none)."""
    runner.graphs = SimpleNamespace(verify=None, can_run=lambda rows, verify=False: DecodeGraphs.can_run(
        SimpleNamespace(buckets=[256], verify_buckets=[]), rows, verify))
    try:
        return runner._graph_rows(entries)
    finally:
        runner.graphs = None


@pytest.mark.parametrize("arch", ["example", "qwen3_next"])
def test_verify_steps_become_one_token_rows_for_the_decode_graphs(arch, example_model_dir, tiny_hybrid_checkpoints):
    """A verify step's entries expand into the one-token rows a decode graph replays (ModelRunner._graph_rows):
    row j of an entry decodes its token j at start + j into its slot j and samples; hybrid models keep
    verifying eagerly (None). The graph itself runs on the GPU (tests/e2e/test_gpu_engine.py)."""
    model = example_model_dir if arch == "example" else tiny_hybrid_checkpoints[arch]
    params = PARAMS["greedy"]
    _, want = _run(model, params)
    truth = {(r.prompt_index, r.sample_index): r.response_token_ids for r in want}
    engine = Engine(model, device="cpu", dtype="float32", max_model_len=256, kv_cache_tokens=4096)
    engine.scheduler.enable_speculation(OracleDrafter(truth, CORRUPTIONS["last"]), 5)
    runner, checked = engine.runner, []
    runner_eager = runner._run_eager

    def spy(out):
        if any(e.num_draft for e in out.entries):
            rows = _rows_graphs_would_replay(runner, out.entries)
            checked.append(rows)
            if rows is not None:
                expected = [(e.request, e.start + j, e.token_ids[j], e.new_slots[j], e.table_row)
                            for e in out.entries for j in range(e.num_new_tokens)]
                assert [(r.request, r.start, r.token_ids[0], r.new_slots[0], r.table_row) for r in rows] == expected
                assert all(r.num_new_tokens == 1 and r.sample and not r.num_draft for r in rows)
        return runner_eager(out)

    runner._run_eager = spy
    _assert_same(sorted(engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], params),
                        key=lambda t: (t.prompt_index, t.sample_index)), want)
    assert checked and all((rows is None) == (arch != "example") for rows in checked)


def test_a_verify_step_that_also_prefills_stays_eager(example_model_dir):
    """A request admitted beside drafting decodes (2 seats, 3 prompts of different lengths) prefills in the
    verify step: such a step keeps off the decode graphs (ModelRunner._graph_rows: None), since its prompt
    rows would each sample and the step's results would not line up with its entries; drafting steps of
    decodes alone expand."""
    prompts = [PromptInput(i, p, params=SamplingParams(max_new_tokens=8 + 7 * i, temperature=0.0, ignore_eos=True))
               for i, p in enumerate(PROMPTS)]
    options = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_tokens=4096)
    want = sorted(Engine(example_model_dir, **options).stream(prompts, SamplingParams()), key=lambda t: t.prompt_index)
    truth = {(r.prompt_index, r.sample_index): r.response_token_ids for r in want}
    engine = Engine(example_model_dir, max_running=2, **options)
    engine.scheduler.enable_speculation(OracleDrafter(truth, CORRUPTIONS["last"]), 5)
    runner, seen = engine.runner, []
    runner_eager = runner._run_eager

    def spy(out):
        if any(e.num_draft for e in out.entries):
            prefills = any(e.num_new_tokens > 1 + e.num_draft for e in out.entries)
            seen.append((prefills, _rows_graphs_would_replay(runner, out.entries) is None))
        return runner_eager(out)

    runner._run_eager = spy
    _assert_same(sorted(engine.stream(prompts, SamplingParams()), key=lambda t: t.prompt_index), want)
    assert (True, True) in seen and (False, False) in seen
    assert all(prefills == eager for prefills, eager in seen)


def test_no_drafts_above_the_max_batch(example_model_dir):
    """--speculative-max-batch 2: steps of more running requests decode without drafts (and may be scheduled
    ahead); once samples finish and two or fewer run, drafts resume. Tokens as plain decoding's."""
    lengths = [6, 12, 24]  # 6 running, then 4, then 2
    prompts = [PromptInput(i, p, params=SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, n=2))
               for i, (p, n) in enumerate(zip(PROMPTS, lengths))]

    def run(truth=None, **options):
        engine = Engine(example_model_dir, device="cpu", dtype="float32", max_model_len=256, kv_cache_tokens=4096,
                        **options)
        if options:
            batches, draft_step = [], engine.scheduler._schedule_decodes_with_drafts
            engine.scheduler._schedule_decodes_with_drafts = lambda out: batches.append(
                len(engine.scheduler.running)) or draft_step(out)
            engine.scheduler.enable_speculation(OracleDrafter(truth, lambda k: False), 4, 2)  # every draft right
        results = sorted(engine.stream(prompts, SamplingParams()), key=lambda t: (t.prompt_index, t.sample_index))
        return engine, results, batches if options else None

    _, want, _ = run()
    truth = {(r.prompt_index, r.sample_index): r.response_token_ids for r in want}
    engine, got, batches = run(truth, speculative="siblings", speculative_max_batch=2)
    _assert_same(got, want)
    assert batches and max(batches) == 2  # drafts only once the 24-token pair runs alone
    assert engine.scheduler.stats.verify_steps > 0 and engine.scheduler.stats.accepted_draft_tokens > 0


def test_refusals(example_model_dir):
    with pytest.raises(RolloutError, match="unknown --speculative 'eagle'; choose siblings or mtp"):
        EngineConfig(model=example_model_dir, speculative="eagle")
    with pytest.raises(RolloutError, match="--num-draft-tokens must be at least 1"):
        EngineConfig(model=example_model_dir, speculative="siblings", num_draft_tokens=0)
    with pytest.raises(RolloutError, match="--speculative-max-batch must be at least 1"):
        EngineConfig(model=example_model_dir, speculative="siblings", speculative_max_batch=0)
    with pytest.raises(RolloutError, match="--tp 1"):
        EngineConfig(model=example_model_dir, speculative="siblings", tensor_parallel_size=2)
    for tuning in (dict(num_draft_tokens=3), dict(speculative_max_batch=8), dict(speculative_gate=False)):
        with pytest.raises(RolloutError, match="tune speculative decoding: give --speculative siblings or mtp too"):
            EngineConfig(model=example_model_dir, **tuning)  # without --speculative: refused, not ignored
    assert EngineConfig(model=example_model_dir).num_draft_tokens is None


def test_rollout_run_with_speculation_writes_the_same_rows_and_reports_acceptance(tmp_path):
    import json
    import os
    import subprocess

    import pyarrow.parquet as pq

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    tables = {}
    for spec in ([], ["--speculative", "siblings", "--num-draft-tokens", "3", "--speculative-max-batch", "16",
                      "--speculative-always"]):  # every step drafts: the acceptance below does not hang on timing
        out = tmp_path / ("spec" if spec else "plain")
        args = ["--model", repo / "recipes" / "example_model", "--data", repo / "recipes" / "prompts.parquet",
                "--out", out, "--n", 4, "--max-new-tokens", 24, "--temperature", 0, "--limit", 4, "--max-running", 4,
                "--device", "cpu", "--dtype", "float32", "--quiet", *spec]
        result = subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", "run", *map(str, args)], env=env,
                                capture_output=True, text=True, timeout=300, cwd=repo)
        assert result.returncode == 0, result.stderr
        tables[bool(spec)] = pq.read_table(out / "trajectories").sort_by(
            [("prompt_index", "ascending"), ("sample_index", "ascending")]).to_pylist()
        manifest = json.loads((out / "manifest.json").read_text())
    assert [r["response_token_ids"] for r in tables[True]] == [r["response_token_ids"] for r in tables[False]]
    speculation = manifest["speculation"]
    assert speculation["acceptance_length"] > 1 and speculation["accepted_draft_tokens"] > 0
    assert "gate_drafting_steps" not in speculation  # --speculative-always: no gate to report
    assert manifest["engine"]["speculative"] == {"method": "siblings", "num_draft_tokens": 3, "max_batch": 16,
                                                 "gate": False}
