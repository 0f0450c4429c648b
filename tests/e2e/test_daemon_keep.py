"""`rollout pause --mode keep` and `--mode finish` on a real daemon: a job held across a weight update
goes on under the new weights, and every written token says which weights sampled it (issue 21)."""

from __future__ import annotations

import json
import threading

import httpx
import pyarrow.dataset as ds
import pytest

from rollout_cli.score_rows import superseded_aborts
from test_daemon import MODEL, PROMPTS, Daemon, _cli, _ok, _rows, _save_variant

MAX_NEW = 300  # long enough that the job is still running when the pause lands
MAX_RUNNING = 8  # 32 samples per job: most wait while the first 8 run


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    work = tmp_path_factory.mktemp("daemon_keep")
    sock = work / "engine.sock"
    proc = Daemon(["--socket", sock, "--max-running", str(MAX_RUNNING)], work / "daemon.log")
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://rollout", timeout=60)
    try:
        proc.wait_ready(client)
        yield dict(sock=sock, http=client, work=work, proc=proc)
    finally:
        client.close()
        proc.kill()


def _job_paused_at_its_start(http, out, mode: str, new, **job):
    """Start a 32-sample job (`job`: more fields of its body); at its first progress event try an update
    (refused: not paused), then pause with `mode`. -> (the client thread, its events, the answers)."""
    body = {"data": str(PROMPTS), "out": str(out), "limit": 8,
            "sampling_params": {"n": 4, "max_new_tokens": MAX_NEW, "ignore_eos": True, "seed": 1}, **job}
    events: list[dict] = []
    held = threading.Event()
    answers: dict = {}

    def client():
        with http.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                events.append(json.loads(line))
                if not held.is_set() and events[-1]["event"] == "progress":
                    # not paused: an update inside the job is refused and names the way to do it
                    answers["unpaused"] = http.post("/update_weights_from_disk", json={"model_path": str(new)})
                    answers["pause"] = http.post("/pause_generation", json={"mode": mode}).json()
                    answers["info"] = http.get("/get_server_info").json()
                    held.set()

    thread = threading.Thread(target=client)
    thread.start()
    assert held.wait(120)
    assert answers["unpaused"].status_code == 409 and "pause --mode keep" in answers["unpaused"].json()["error"]
    assert answers["pause"]["state"] == "paused" and answers["pause"]["mode"] == mode
    return thread, events, answers


@pytest.fixture(scope="module")
def new_weights(daemon):
    return _save_variant(MODEL, daemon["work"] / "new", lambda t: {k: v * 1.1 if "mlp" in k else v for k, v in t.items()})


def test_a_job_held_with_keep_takes_new_weights_and_labels_every_token(daemon, new_weights):
    http, work, new = daemon["http"], daemon["work"], new_weights
    out = work / "keep"
    thread, events, answers = _job_paused_at_its_start(http, out, "keep", new)
    assert answers["info"]["state"] == "paused" and answers["info"]["job"]["out"] == str(out)
    reload = _ok(_cli(["reload-weights", new, "--engine", daemon["sock"]]))
    assert reload.stdout.startswith("weight version 0 -> 1")
    _ok(_cli(["continue", "--engine", daemon["sock"]]))
    thread.join(300)
    assert events[-1]["event"] == "done", events[-1]
    rows = _rows(out)
    assert len(rows) == 8 * 4 and {r["finish_reason"] for r in rows} == {"length"}
    split = 0
    for row in rows:
        versions = row["response_weight_versions"]
        assert len(versions) == len(row["response_token_ids"]) == len(row["response_logprobs"]) == MAX_NEW
        k = versions.count("0")
        assert versions == ["0"] * k + ["1"] * (MAX_NEW - k) and row["weight_version"] == "1"
        split += k > 0
    assert split > 0  # the samples running at the pause kept the tokens they had
    assert "Traceback" not in (daemon["work"] / "daemon.log").read_text()


def test_pause_finish_lets_running_samples_end_then_the_rest_run_on_the_new_weights(daemon, new_weights):
    http, work = daemon["http"], daemon["work"]
    out = work / "finish"
    thread, events, answers = _job_paused_at_its_start(http, out, "finish", new_weights)
    # the pause answered once the samples running at it had finished; those are the only ones done
    done_at_pause = answers["info"]["job"]["trajectories"]
    assert 0 < done_at_pause <= MAX_RUNNING
    reload = _ok(_cli(["reload-weights", new_weights, "--version", "2", "--engine", daemon["sock"]]))
    assert "-> 2" in reload.stdout
    _ok(_cli(["continue", "--engine", daemon["sock"]]))
    thread.join(300)
    assert events[-1]["event"] == "done", events[-1]
    rows = _rows(out)
    assert len(rows) == 8 * 4 and {r["finish_reason"] for r in rows} == {"length"}
    versions = [set(r["response_weight_versions"]) for r in rows]
    assert all(len(v) == 1 for v in versions)  # no sample mixes weights
    assert sum(v == {"1"} for v in versions) == done_at_pause and sum(v == {"2"} for v in versions) == 32 - done_at_pause


def test_aborted_samples_are_continued_by_resume_continue_aborted(daemon, new_weights):
    """APRIL's carry-over through files: a job aborted on the daemon, then `run --resume
    --continue-aborted` on an embedded engine with the same weights: each aborted row is replaced by
    its whole sample, which keeps the tokens it had, and each token records which engine's weights (by
    version) sampled it. Against an uninterrupted run: a continuation prefills prompt + response
    where the uninterrupted sample decoded them, so its logits differ by float32 rounding, and at
    temperature 1 over 9,600 tokens that can move a draw across a boundary (seen 2026-12-05: a
    sample diverged at its token 233); so nearly all samples must be equal, and every sample equal
    up to its first difference, logprobs to 1e-4."""
    http, work = daemon["http"], daemon["work"]
    out = work / "carried"
    thread, events, _ = _job_paused_at_its_start(http, out, "abort", new_weights)
    thread.join(120)
    _ok(_cli(["continue", "--engine", daemon["sock"]]))
    assert events[-1]["event"] == "aborted"
    before = _rows(out)  # finished and aborted samples; those never admitted are not written
    sampled_before = {(r["prompt_index"], r["sample_index"]): len(r["response_token_ids"]) for r in before}
    assert any(r["finish_reason"] == "abort" for r in before) and len(before) < 32
    version = json.loads((out / "manifest.json").read_text())["weight_version"]
    args = ["--model", new_weights, "--data", PROMPTS, "--n", "4", "--limit", "8", "--max-new-tokens", MAX_NEW,
            "--ignore-eos", "--seed", "1", "--quiet"]
    plain = _cli(["run", "--out", out, "--resume", *args])  # another checkpoint: refused
    assert plain.returncode == 2 and "another checkpoint" in plain.stderr
    _ok(_cli(["run", "--out", out, "--resume", "--continue-aborted", *args]))
    _ok(_cli(["run", "--out", work / "uninterrupted", *args]))
    rows, want = _rows(out), _rows(work / "uninterrupted")
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, s) for p in range(8) for s in range(4)]
    assert {r["finish_reason"] for r in rows} == {"length"}
    before_tokens = {(r["prompt_index"], r["sample_index"]): r["response_token_ids"] for r in before}
    equal = 0
    for row, ref in zip(rows, want, strict=True):
        pair = (row["prompt_index"], row["sample_index"])
        k = sampled_before.get(pair, 0)
        assert row["response_token_ids"][:k] == before_tokens.get(pair, [])  # what it had, kept
        assert row["response_weight_versions"] == [version] * k + ["0"] * (MAX_NEW - k)
        same = next((i for i, (a, b) in enumerate(zip(row["response_token_ids"], ref["response_token_ids"]))
                     if a != b), MAX_NEW)
        assert row["response_logprobs"][:same] == pytest.approx(ref["response_logprobs"][:same], abs=1e-4)
        equal += same == MAX_NEW
    assert equal >= 0.9 * len(rows)


def test_a_continuation_aborted_again_leaves_one_row_per_sample(daemon, new_weights):
    """A job aborted, continued on the daemon (resume + continue_aborted) and aborted again: a sample aborted
    twice wrote a second aborted row, and the older one stayed beside it (only a finished row superseded
    it), so the run held two rows of one sample and `rollout score` refused it. The newest aborted row
    (its response extends the older one's) replaces the older: one row per sample once the job ends."""
    http, work = daemon["http"], daemon["work"]
    out = work / "aborted_twice"
    for job in ({}, {"resume": True, "continue_aborted": True}):
        thread, events, _ = _job_paused_at_its_start(http, out, "abort", new_weights, **job)
        thread.join(120)
        _ok(_cli(["continue", "--engine", daemon["sock"]]))
        assert events[-1]["event"] == "aborted", events[-1]
        if not job:
            first = {(r["prompt_index"], r["sample_index"]): r for r in _rows(out)}
    rows = _rows(out)
    pairs = [(r["prompt_index"], r["sample_index"]) for r in rows]
    assert len(pairs) == len(set(pairs)), "a sample has two rows"
    aborted_twice = [r for r in rows if r["finish_reason"] == "abort"
                     and first.get((r["prompt_index"], r["sample_index"]), {}).get("finish_reason") == "abort"]
    assert aborted_twice  # the second abort hit continued samples
    for row in rows:  # a continued sample kept what it had
        before = first.get((row["prompt_index"], row["sample_index"]))
        if before is not None:
            k = len(before["response_token_ids"])
            assert row["response_token_ids"][:k] == before["response_token_ids"]
    assert superseded_aborts(ds.dataset(out / "trajectories"), str(out)) == (frozenset(), 0)  # score reads it
