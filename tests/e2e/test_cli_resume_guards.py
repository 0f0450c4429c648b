"""--resume never mixes runs, and never meets another job still writing OUT: a manifest that is missing,
a score's or damaged, shards with stray or malformed keys, another dtype or model length, and a second
job on an OUT in use are each refused in one line with OUT left as it was; a NaN temperature is refused
before anything runs."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_cli.errors import RolloutError
from rollout_cli.io.output_lock import OutputLock
from test_cli_resume_fingerprint import PROMPTS, _manifest, _ok, _partial, _run, _snapshot


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory):
    """A killed run's OUT: whole shards for part of the samples, its manifest."""
    out = tmp_path_factory.mktemp("guards") / "run"
    _ok(_run(out))
    _partial(out)
    return out


def _resume(out, *extra):
    return _run(out, "recipes/example_model", PROMPTS, "--resume", *extra)


def _refused(out, *extra, message: str) -> None:
    before = _snapshot(out)
    result = _resume(out, *extra)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert _snapshot(out) == before  # nothing written, nothing deleted


def _copy(partial_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(partial_run, out)
    return out


def test_shards_without_a_manifest(partial_run, tmp_path):
    out = _copy(partial_run, tmp_path)
    (out / "manifest.json").unlink()
    _refused(out, message="holds trajectory shards but no manifest.json")


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("sampling"), "damaged: it records no sampling settings"),
    (lambda m: m.update(sampling=None, settings={}), "is a score's (rollout score), not a run's"),
    (lambda m: m["fingerprints"].pop("data"), "is damaged (its fingerprints need checkpoint, data, weights)"),
    (lambda m: m["fingerprints"].update(checkpoint="x"), "is damaged"),
])
def test_a_manifest_that_is_not_a_runs(partial_run, tmp_path, edit, message):
    out = _copy(partial_run, tmp_path)
    manifest = _manifest(out)
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    _refused(out, message=message)


@pytest.mark.parametrize("rows, message", [
    ({"prompt_index": [999], "sample_index": [7]}, "holds sample (999, 7)"),
    ({"prompt_index": [-1], "sample_index": [0]}, "holds sample (-1, 0)"),
    ({"prompt_index": pa.array([None], pa.int64()), "sample_index": [0]}, "must be integers without nulls"),
    ({"prompt_index": ["a"], "sample_index": ["b"]}, "must be integers without nulls"),
])
def test_shards_with_stray_keys(partial_run, tmp_path, rows, message):
    out = _copy(partial_run, tmp_path)
    pq.write_table(pa.table(rows), out / "trajectories" / "part-00099.parquet")
    _refused(out, message=message)


@pytest.mark.parametrize("extra, message", [
    (["--dtype", "bfloat16"], "dtype='float32', this run has 'bfloat16'"),
    (["--max-model-len", "100"], "max_model_len="),
])
def test_another_dtype_or_model_length(partial_run, tmp_path, extra, message):
    _refused(_copy(partial_run, tmp_path), *extra, message=message)


def test_a_second_job_on_an_out_in_use(partial_run, tmp_path):
    """The first job's lock (held here as a running job holds it) turns the second away before it deletes
    or writes anything; once released, the resume completes the run."""
    out = _copy(partial_run, tmp_path)
    with OutputLock(str(out)) as lock:
        lock.hold()
        _refused(out, message="another rollout job is writing")
        with pytest.raises(RolloutError, match="another rollout job"):  # in one process too: one job per OUT
            with OutputLock(str(out)):
                pass
    _ok(_resume(out))
    assert _manifest(out)["status"] == "complete"


def test_a_nan_temperature_is_one_line(tmp_path):
    result = _run(tmp_path / "nan", "recipes/example_model", PROMPTS, "--temperature", "nan")
    assert result.returncode == 2 and "--temperature must be a finite number" in result.stderr, result.stderr
    assert not (tmp_path / "nan").exists()
