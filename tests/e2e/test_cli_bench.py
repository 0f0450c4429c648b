"""`rollout bench` end to end on the CPU: the report's numbers add up, the HF baseline runs on the same
prompts, mixed lengths follow their ranges, routing capture can be compared, bad flags are one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_cli.cli.bench import abba_spread

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "example_model"


def _bench(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", "bench", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def test_fixed_workload_with_hf_baseline(tmp_path):
    report_path = tmp_path / "bench.json"
    result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 6, "--input-len", 12, "--output-len", 9,
                    "--n", 2, "--baseline", "hf", "--baseline-batch", 3, "--json", report_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    rollout = report["rollout"]
    assert rollout["requests"] == 12 and rollout["output_tokens"] == 12 * 9  # eos ignored
    # of each prompt's 2 x 12 tokens the second sample takes 11 from the first (the last one is computed)
    assert rollout["output_tokens_per_s"] > 0 and abs(rollout["prefix_hit_rate"] - 11 / 24) < 1e-9
    assert report["hf"]["output_tokens_per_s"] > 0
    # the n = 2 samples of a prompt share its cached KV: the limit counts it once per step
    bandwidth = report["bandwidth"]
    assert 0 < bandwidth["decode_distinct_context_tokens"] < bandwidth["decode_context_tokens"]
    assert bandwidth["decode_bytes"] < bandwidth["decode_bytes_per_sample_reads"]
    assert abs(report["speedup_vs_hf"] - rollout["output_tokens_per_s"] / report["hf"]["output_tokens_per_s"]) < 1e-9
    assert "output tok/s" in result.stdout and "speedup vs HF" in result.stdout


def test_mixed_lengths_follow_their_ranges(tmp_path):
    report_path = tmp_path / "bench.json"
    result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 8, "--input-len-range", 5, 20,
                    "--output-len-range", 3, 11, "--temperature", 0.6, "--json", report_path)
    assert result.returncode == 0, result.stderr
    rollout = json.loads(report_path.read_text())["rollout"]
    assert rollout["requests"] == 8 and 8 * 3 <= rollout["output_tokens"] <= 8 * 11


def test_fp8_kv_cache_bench_reports_the_pool_it_ran_on(tmp_path):
    """--kv-cache-dtype fp8: the report names the pool's dtype and size (the e4m3 pool of the same
    --kv-cache-tokens takes a quarter of float32's bytes, the bandwidth limit counts them)."""
    reports = {}
    for kv in ("auto", "fp8"):
        report_path = tmp_path / f"{kv}.json"
        result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 4, "--input-len", 8, "--output-len", 5,
                        "--kv-cache-dtype", kv, "--kv-cache-tokens", 200, "--max-model-len", 64,
                        "--json", report_path)
        assert result.returncode == 0, result.stderr
        reports[kv] = json.loads(report_path.read_text())
        assert "KV cache" in result.stdout and "199 tokens" in result.stdout
    assert reports["fp8"]["rollout"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert reports["auto"]["rollout"]["kv_cache_dtype"] == "float32"
    assert reports["auto"]["bandwidth"]["kv_bytes_per_token"] == 4 * reports["fp8"]["bandwidth"]["kv_bytes_per_token"]


def test_turns_run_episodes_whose_later_turns_prefill_only_new_tokens(tmp_path):
    """--turns: multi-turn episodes with a synthetic environment; each later turn prefills only the
    environment's tokens and the previous turn's last token (the conversation stays pinned)."""
    report_path = tmp_path / "bench.json"
    result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 4, "--n", 2, "--input-len", 20,
                    "--output-len", 6, "--turns", 3, "--observation-len", 5, "--json", report_path)
    assert result.returncode == 0, result.stderr
    rollout = json.loads(report_path.read_text())["rollout"]
    episodes = rollout["episodes"]
    assert rollout["requests"] == 8 and rollout["output_tokens"] == 8 * 3 * 6  # model tokens only
    assert episodes["turns"] == 8 * 3
    assert episodes["later_turn_new_tokens_mean"] == 5 + 1
    assert episodes["later_turn_prefill_tokens_mean"] == 5 + 1
    assert episodes["later_turns_prefilling_only_new_tokens"] == 1.0
    # turn 1: the second sample of a prompt reads 19 of its 20 prompt tokens; turns 2 and 3 read all but 6
    prompt_tokens = 8 * 20 + 8 * (20 + 11) + 8 * (20 + 22)
    cached = 4 * 19 + 8 * (20 + 11 - 6) + 8 * (20 + 22 - 6)
    assert episodes["turn_prompt_tokens"] == prompt_tokens and episodes["turn_cached_tokens"] == cached
    assert "later turns: prefilled / new" in result.stdout


def test_episodes_start_only_while_their_kv_fits_so_later_turns_never_re_prefill(tmp_path):
    """16 six-turn episodes of 64 + 6 x (16 + 8) tokens (3,328 in all) on a 2,000-token KV pool: started all
    at once they outgrew the pool and later turns re-prefilled their conversations (a 32.8% hit rate, 87
    tokens prefilled per later turn for 9 new); now rows wait for room and every turn reads its whole
    conversation from the cache."""
    report_path = tmp_path / "bench.json"
    result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 16, "--input-len", 64, "--output-len", 16,
                    "--turns", 6, "--observation-len", 8, "--kv-cache-tokens", 2000, "--max-model-len", 512,
                    "--json", report_path)
    assert result.returncode == 0, result.stderr
    rollout = json.loads(report_path.read_text())["rollout"]
    episodes = rollout["episodes"]
    assert episodes["turns"] == 16 * 6
    assert rollout["admission_held_steps"] == 0  # admission pacing holds nothing while steps run eagerly (CPU)
    assert rollout["eager_step_cost"] == 2.0  # nothing measured it: no CUDA graphs
    assert episodes["later_turns_prefilling_only_new_tokens"] == 1.0
    # only each first prompt and each later turn's 8 observation tokens + the last response token are computed
    assert episodes["turn_prompt_tokens"] - episodes["turn_cached_tokens"] == 16 * 64 + 16 * 5 * 9
    assert episodes["peak_open_episodes"] < 16 and episodes["episode_rows_held_for_kv"] > 0
    assert "episodes open at once" in result.stdout


def test_carry_over_compares_waiting_with_carrying_the_tail(tmp_path):
    """--long-tail and --carry-over: rounds of a long-tailed workload, waited out, then carried over
    at 75%; waiting generates every token of every round, carrying no more than that."""
    report_path = tmp_path / "bench.json"
    result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 8, "--n", 2, "--input-len", 10,
                    "--output-len", 32, "--long-tail", 0.25, "--carry-over", 2, "--carry-at", 0.75,
                    "--seed", 1, "--json", report_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    lengths = report["rollout"]["output_tokens"]  # one pass over the workload: its lengths, n = 2
    tail = report["long_tail"]
    assert tail["wait"]["output_tokens"] == 2 * lengths
    assert 0 < tail["carry"]["output_tokens"] <= 2 * lengths
    assert len(tail["wait"]["rounds"]) == 2 and 0 < tail["wait"]["tail_share_of_time"] < 1
    assert tail["carry"]["unfinished_after_last_round"] >= 0
    assert tail["throughput_gain"] == pytest.approx(
        tail["carry"]["output_tokens_per_s"] / tail["wait"]["output_tokens_per_s"] - 1)
    assert "carry over at 75%" in result.stdout


def test_long_tail_lengths():
    from rollout_cli.bench import BenchConfig, make_workload

    workload = make_workload(BenchConfig(num_prompts=400, output_len=160, long_tail=0.1, seed=3), vocab_size=50)
    long = sum(n == 160 for n in workload.output_lens)
    assert 20 <= long <= 60  # about 10% at the maximum
    assert all(n == 160 or 10 <= n <= 40 for n in workload.output_lens)


def test_routing_capture_compare_on_a_moe_model(tiny_moe_checkpoints, tmp_path):
    report_path = tmp_path / "bench.json"
    result = _bench("--model", tiny_moe_checkpoints["qwen3_moe"], "--device", "cpu", "--num-prompts", 4,
                    "--input-len", 10, "--output-len", 6, "--capture-routing", "compare", "--json", report_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    assert report["rollout_capture"]["output_tokens"] == report["rollout"]["output_tokens"] == 24
    runs = report["capture_runs"]
    assert [r["capture"] for r in runs] == ["off", "on", "on", "off"]
    off, on = runs[0]["seconds"] + runs[3]["seconds"], runs[1]["seconds"] + runs[2]["seconds"]
    assert report["capture_overhead"] == pytest.approx(1 - off / on)
    assert "capture overhead" in result.stdout


def test_deterministic_times_both_modes_in_one_run(tmp_path):
    report_path = tmp_path / "bench.json"
    result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 3, "--input-len", 6, "--output-len", 4,
                    "--deterministic", "--json", report_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    assert report["engine_settings"]["deterministic"] is True
    runs = report["mode_runs"]
    assert [r["deterministic"] for r in runs] == [False, True, True, False]
    assert report["rollout"]["output_tokens"] == report["rollout_default"]["output_tokens"] == 12
    default, on_policy = runs[0]["seconds"] + runs[3]["seconds"], runs[1]["seconds"] + runs[2]["seconds"]
    assert report["deterministic_cost"] == pytest.approx(1 - default / on_policy)
    assert report["abba_spread"] == pytest.approx(abba_spread(runs))
    assert "on-policy cost" in result.stdout and "runs of one setting differ by up to" in result.stdout


def test_abba_spread_is_the_larger_gap_within_a_setting():
    runs = [{"seconds": s} for s in (4.0, 3.0, 3.3, 3.0)]  # a slow first run: the default side's gap, 25%
    assert abba_spread(runs) == pytest.approx(0.25)
    assert abba_spread([{"seconds": 2.0}] * 4) == 0


def test_bad_flags_are_one_line(tmp_path):
    dense = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 2, "--capture-routing", "compare")
    assert dense.returncode == 2 and len(dense.stderr.strip().splitlines()) == 1
    assert "needs a mixture-of-experts model" in dense.stderr
    mode = _bench("--model", MODEL, "--device", "cpu", "--capture-routing", "sometimes")
    assert mode.returncode == 2 and "unknown --capture-routing 'sometimes'" in mode.stderr


@pytest.mark.parametrize("flags, message", [
    (("--json", "."), "is a directory"),
    (("--json", "no/such/dir/report.json"), "does not exist"),
    (("--json", ""), "--json needs a file path"),  # was read as no --json: a run without its report
    (("--baseline", "hf", "--baseline-batch", 0), "--baseline-batch must be at least 1"),
    (("--baseline-batch", -1), "--baseline-batch must be at least 1"),
    (("--baseline-time-limit", -1), "--baseline-time-limit is seconds"),
    (("--baseline-time-limit", "nan"), "--baseline-time-limit is seconds"),
    (("--seed", 2**64), f"--seed {2**64} is out of range"),  # was taken modulo 2^64 (the sampler's 64-bit key)
    (("--seed", -1), "--seed -1 is out of range"),
])
def test_bad_report_path_and_baseline_flags_are_one_line_before_the_model_loads(flags, message):
    """A model that is not there: the flag is refused first, not after loading and timing."""
    result = _bench("--model", "no/such/model", "--device", "cpu", *flags)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a file whose writes fail ENOSPC")
def test_a_report_that_cannot_be_written_is_one_line_after_the_table():
    """A full disk at the end of the run was an OSError traceback, and the table was never printed."""
    result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 2, "--input-len", 4, "--output-len", 3,
                    "--json", "/dev/full")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "--json /dev/full: the report could not be written (No space left on device)" in result.stderr
    assert "output tok/s" in result.stdout and "Traceback" not in result.stderr


RAISE = "or raise --max-model-len (the model allows up to 2048)"


@pytest.mark.parametrize("flags, message", [
    (("--max-model-len", 64, "--input-len", 40, "--output-len", 30),
     "needs 70 tokens (its longest prompt, 40, + --output-len 30), past the max model length 64 (--max-model-len), "
     f"where the engine would cut it short; lower --output-len or lower --input-len, {RAISE}"),
    (("--max-model-len", 64, "--input-len-range", 4, 8, "--output-len-range", 4, 60),
     f"--output-len-range's upper end 60), past the max model length 64 (--max-model-len), where the engine would "
     f"cut it short; lower --output-len-range or lower --input-len-range, {RAISE}"),
    (("--input-len", 8, "--output-len", 2041), "past the max model length 2048 (max_position_embeddings in "
     "config.json), where the engine would cut it short; lower --output-len or lower --input-len (the model has "
     "no more positions)"),
    (("--max-model-len", 64, "--input-len", 8, "--output-len", 8, "--turns", 3, "--observation-len", 17),
     "needs 66 tokens (its longest prompt, 8, + --output-len 8 x 3 turns + 2 x --observation-len 17), past"),
])
def test_a_workload_past_the_max_model_len_is_one_line(flags, message):
    """A sample past the engine's max model length was cut there silently (finish_reason length): the run timed
    fewer tokens than the workload asked. Refused before any timing, as vLLM's throughput benchmark does."""
    result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 2, *flags)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr, result.stderr


def test_data_without_rows_is_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 2, "--output-len", 4, "--data", empty)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"--data {empty} holds no prompts" in result.stderr


def test_hf_baseline_time_limit_reports_a_bound():
    """A baseline stopped at its time limit reports at most what the whole run could reach: the time
    spent plus every step left at the fastest step measured."""
    import torch

    from rollout_cli.bench import BenchConfig, make_workload, run_hf_baseline

    cfg = BenchConfig(num_prompts=4, input_len=8, output_len=12, baseline="hf", baseline_batch=2)
    workload = make_workload(cfg, vocab_size=300)
    full = run_hf_baseline(str(MODEL), "auto", torch.device("cpu"), torch.float32, workload, cfg)
    assert full["complete"] and full["output_tokens_per_s"] == pytest.approx(4 * 12 / full["seconds"])

    stopped_cfg = BenchConfig(num_prompts=4, input_len=8, output_len=12, baseline="hf", baseline_batch=2,
                              baseline_time_limit=1e-6)  # spent by the first token of the first batch
    stopped = run_hf_baseline(str(MODEL), "auto", torch.device("cpu"), torch.float32, workload, stopped_cfg)
    assert not stopped["complete"]
    assert stopped["tokens_done"] == 2 * 2  # two tokens of each row of the first batch (the 2nd call stops)
    assert stopped["steps_left"] == (12 - 2) + 12  # the rest of batch 1, all of batch 2
    assert stopped["seconds_at_least"] == pytest.approx(stopped["seconds"] + 22 * stopped["fastest_step_s"])
    assert stopped["output_tokens_per_s"] == pytest.approx(48 / stopped["seconds_at_least"])
    assert stopped["fastest_step_s"] > 0


def test_kv_pressure_reports_preemptions_what_they_recompute_and_the_tail(tmp_path):
    """A KV cache too small for the batch: samples are preempted and recompute what the prefix cache
    did not keep; the report counts those tokens, the peak running batch and the last 10%'s time."""
    report_path = tmp_path / "bench.json"
    result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 8, "--input-len", 8, "--output-len", 24,
                    "--kv-cache-tokens", 80, "--max-model-len", 40, "--max-running", 8, "--json", report_path)
    assert result.returncode == 0, result.stderr
    rollout = json.loads(report_path.read_text())["rollout"]
    assert rollout["output_tokens"] == 8 * 24
    assert rollout["preemptions"] > 0 and rollout["recomputed_tokens"] > 0
    assert 2 <= rollout["peak_running"] <= 8
    assert 0 <= rollout["last_10pct_seconds"] <= rollout["seconds"]
    assert "recomputed tokens" in result.stdout and "last 10% of samples" in result.stdout


def test_images_on_a_vision_language_model(tmp_path):
    """--images: every prompt carries its own image; the vision tower runs once per image in the timed
    run (the warm-up's encodings are dropped), its share of the run is reported, HF runs the same images."""
    sys.path.insert(0, str(REPO / "tests"))
    from vlm_fixtures import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "vlm", "qwen3_vl")
    report_path = tmp_path / "bench.json"
    result = _bench("--model", model, "--device", "cpu", "--num-prompts", 4, "--input-len", 6, "--output-len", 5,
                    "--n", 2, "--images", 1, "--image-size", 32, 64, "--baseline", "hf", "--json", report_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    rollout = report["rollout"]
    assert rollout["requests"] == 8 and rollout["output_tokens"] == 8 * 5
    assert rollout["images_encoded"] == 4 and 0 < rollout["vision_share"] < 1
    assert report["hf"]["output_tokens_per_s"] > 0 and "vision tower" in result.stdout
    # 32 x 64 pixels = 8 x 16 patches of 4, 32 tokens after the 2 x 2 merge, between vision start and end
    assert rollout["total_tokens_per_s"] * rollout["seconds"] == pytest.approx(8 * (34 + 6 + 5))


def test_images_need_a_vision_model_and_a_whole_number_of_merged_patches(tmp_path):
    result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 2, "--images", 1)
    assert result.returncode != 0 and "needs a vision-language checkpoint" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    sys.path.insert(0, str(REPO / "tests"))
    from vlm_fixtures import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "vlm", "qwen3_vl")
    result = _bench("--model", model, "--device", "cpu", "--num-prompts", 2, "--images", 1, "--image-size", 30, 64)
    assert result.returncode != 0 and "multiple of 8" in result.stderr


def test_random_ids_on_a_vision_language_model_hold_no_vision_tokens():
    """Without --images, the random prompt ids of a VL checkpoint's workload never hold its vision token
    ids (the engine refuses image placeholders without images)."""
    from types import SimpleNamespace

    from rollout_cli.bench import BenchConfig, make_workload

    config = SimpleNamespace(vision_config=object(), image_token_id=3, video_token_id=4, vision_start_token_id=1,
                             vision_end_token_id=2)
    workload = make_workload(BenchConfig(num_prompts=16, input_len=64), 6, hf_config=config)
    tokens = {t for prompt in workload.prompts for t in prompt}
    assert tokens == {0, 5}  # 1..4 drawn from range(6) became 0
    assert make_workload(BenchConfig(num_prompts=16, input_len=64), 6).prompts[0] != workload.prompts[0]


def test_speculative_reports_what_the_gate_let_draft(tmp_path):
    """The default --speculative (the gate on): the drafted run's report says in how many of its decode
    steps the gate let drafts run (which ones is timing's call; the steps' count is not)."""
    report_path = tmp_path / "bench.json"
    result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 2, "--n", 2, "--input-len", 6,
                    "--output-len", 8, "--temperature", 0, "--speculative", "siblings", "--json", report_path)
    assert result.returncode == 0, result.stderr
    rollout = json.loads(report_path.read_text())["rollout"]
    assert rollout["gate_drafting_steps"] + rollout["gate_plain_steps"] >= 6  # 8 tokens: 7 decode steps at most
    assert "speculation gate" in result.stdout and "decode steps" in result.stdout
    busiest = rollout["gate_busiest_bucket"]  # what the gate measured where the run spent most decode steps
    assert busiest["plain_steps"] + busiest["drafting_steps"] >= 2 and busiest["plain_ms"] > 0
    assert f"gate at batch {busiest['batch']}+" in result.stdout


def test_speculative_times_decoding_with_and_without_drafts(tmp_path):
    """--speculative: plain decoding and decoding with sibling drafts on one engine (ABBA), the speedup
    from the sums of times, the acceptance length from the drafted run; both runs write the same tokens."""
    report_path = tmp_path / "bench.json"
    result = _bench("--model", MODEL, "--device", "cpu", "--num-prompts", 2, "--n", 4, "--input-len", 6,
                    "--output-len", 12, "--temperature", 0, "--speculative", "siblings", "--num-draft-tokens", 3,
                    "--speculative-always", "--json", report_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    runs = report["speculation_runs"]
    assert [r["speculative"] for r in runs] == [False, True, True, False]
    assert report["rollout"]["output_tokens"] == report["rollout_plain"]["output_tokens"] == 2 * 4 * 12
    plain, drafted = runs[0]["seconds"] + runs[3]["seconds"], runs[1]["seconds"] + runs[2]["seconds"]
    assert report["speculation_speedup"] == pytest.approx(plain / drafted)
    assert report["rollout"]["acceptance_length"] > 1 and "acceptance_length" not in report["rollout_plain"]
    assert "speculation speedup" in result.stdout and "tokens per verifying step" in result.stdout
    # the bound needs graph-replayed decode steps' time (bench_limits.speculation_bound): the CPU times none
    assert "speculation_bound" in report and report["speculation_bound"] is None and "at most" not in result.stdout


def test_mtp_on_dummy_weights_says_the_head_is_random(tiny_hybrid_checkpoints, tmp_path):
    """--speculative mtp --load-format dummy: a random head drafts nothing the model samples, and the report
    says so (its 1.00 tokens per verifying step once read as a GPU bug); the checkpoint's own head gets no note."""
    sys.path.insert(0, str(REPO / "tests"))
    from mtp_fixtures import with_mtp_head

    model = with_mtp_head(tiny_hybrid_checkpoints["qwen3_next"], tmp_path / "mtp")
    notes = []
    for load_format in ("dummy", "auto"):
        result = _bench("--model", model, "--device", "cpu", "--dtype", "float32", "--num-prompts", 2, "--input-len", 6,
                        "--output-len", 4, "--temperature", 0, "--speculative", "mtp", "--load-format", load_format)
        assert result.returncode == 0, result.stderr
        notes.append("gives the MTP head random weights" in result.stdout)
    assert notes == [True, False]
