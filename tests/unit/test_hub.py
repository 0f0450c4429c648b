"""Hub model ids (rollout_cli/models/hub.py), resolved offline against a cache laid out as the hub's
(tests/conftest.py: make_hub_cache). Nothing here touches the network: HF_HUB_OFFLINE is on."""

from __future__ import annotations

import shutil

import huggingface_hub.constants
import pytest
from huggingface_hub.utils import filter_repo_objects

from hub_cache import COMMIT_MAIN, COMMIT_V2, HUB_ID
from rollout_cli.config import EngineConfig
from rollout_cli.errors import RolloutError
from rollout_cli.models.hub import (IGNORE_PATTERNS, HubSource, allow_patterns, pinned_argv, resolve_engine_config,
                                    resolve_model, source_change)

# A repository as the hub holds them: weights in several formats, tokenizer files, subfolders.
REPO_FILES = [
    ".gitattributes", "README.md", "LICENSE", "config.json", "generation_config.json",
    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.pth", "model.gguf",
    "flax_model.msgpack", "tf_model.h5", "onnx/model.onnx", "original/consolidated.00.pth",
    "original/model.safetensors", "original/params.json", "tokenizer.json", "tokenizer_config.json",
    "tokenizer.model", "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "preprocessor_config.json", "processor_config.json", "qwen.tiktoken",
]
ENGINE_FILES = {
    "config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "qwen.tiktoken",
}
WEIGHT_FILES = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                "model.safetensors.index.json"}


def _fetched(weights: bool) -> set[str]:
    return set(filter_repo_objects(REPO_FILES, allow_patterns=allow_patterns(weights),
                                   ignore_patterns=list(IGNORE_PATTERNS)))


def test_only_the_files_the_engine_reads_are_fetched():
    assert _fetched(weights=True) == ENGINE_FILES | WEIGHT_FILES


def test_dummy_weights_fetch_no_weights():
    assert _fetched(weights=False) == ENGINE_FILES


@pytest.fixture
def offline_cache(hub_cache, monkeypatch, tmp_path):
    """The fake cache as huggingface_hub's cache, offline; the working directory an empty one (so no
    local directory shadows an id)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache["cache"]))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    return hub_cache


@pytest.mark.parametrize("revision, commit", [(None, COMMIT_MAIN), ("main", COMMIT_MAIN), ("v2", COMMIT_V2),
                                              (COMMIT_V2, COMMIT_V2), (COMMIT_MAIN, COMMIT_MAIN)])
def test_hub_id_resolves_to_the_snapshot_of_its_revision(offline_cache, revision, commit):
    resolved = resolve_model(HUB_ID, revision)
    assert resolved.path == str(offline_cache["snapshots"][commit])
    assert resolved.source == HubSource(HUB_ID, revision or "main", commit)


def test_the_snapshots_hold_other_weights(offline_cache):
    main, v2 = (offline_cache["snapshots"][c] / "model.safetensors" for c in (COMMIT_MAIN, COMMIT_V2))
    assert main.read_bytes() != v2.read_bytes()  # else the revision tests could not tell them apart


@pytest.mark.parametrize("hub_id, revision", [("rollout-test/absent", None), (HUB_ID, "no-such-branch")])
def test_uncached_offline_is_one_line_naming_id_revision_and_fix(offline_cache, hub_id, revision):
    with pytest.raises(RolloutError) as err:
        resolve_model(hub_id, revision)
    message = str(err.value)
    assert "\n" not in message
    for words in (hub_id, f"revision {revision or 'main'}", "HF_HUB_OFFLINE", str(offline_cache["cache"])):
        assert words in message


@pytest.mark.parametrize("model", ["a/b/c", "", "../nope", "org/../name", "org//name", "name-"*30])
def test_bad_ids_are_one_line(offline_cache, model):
    with pytest.raises(RolloutError, match="neither a local directory nor a valid hub id") as err:
        resolve_model(model)
    assert "\n" not in str(err.value)


def test_local_directory_wins_over_a_hub_id_of_the_same_spelling(offline_cache, example_model_dir, tmp_path):
    shutil.copytree(example_model_dir, tmp_path / HUB_ID)  # cwd is tmp_path: "rollout-test/tiny" is a directory
    assert resolve_model(HUB_ID).path == HUB_ID
    assert resolve_model(HUB_ID).source is None
    with pytest.raises(RolloutError, match="--revision v2 .* is a local directory"):
        resolve_model(HUB_ID, "v2")  # not silently ignored


def test_engine_config_resolution_is_done_once(offline_cache):
    config = resolve_engine_config(EngineConfig(model=HUB_ID, revision="v2"))
    assert config.model == str(offline_cache["snapshots"][COMMIT_V2])
    assert config.model_source == HubSource(HUB_ID, "v2", COMMIT_V2)
    assert resolve_engine_config(config) is config  # Engine(config) after the CLI resolved it: unchanged
    local = EngineConfig(model=config.model)
    assert resolve_engine_config(local) is local


def test_ranks_are_pinned_to_the_resolved_commit(offline_cache):
    config = resolve_engine_config(EngineConfig(model=HUB_ID))
    argv = ["--model", HUB_ID, "--revision=main", "--n", "2"]
    assert pinned_argv(argv, config) == ["--model", HUB_ID, "--n", "2", "--revision", COMMIT_MAIN]
    local = EngineConfig(model=config.model)
    assert pinned_argv(argv, local) == argv


def test_source_change_names_both_commits():
    main = HubSource(HUB_ID, "main", COMMIT_MAIN).as_dict()
    v2 = HubSource(HUB_ID, "v2", COMMIT_V2).as_dict()
    assert source_change(main, dict(main, revision=COMMIT_MAIN)) is None  # same commit, other spelling
    assert source_change(None, v2) is None  # a local directory then: the content fingerprint decides
    change = source_change(main, v2)
    assert COMMIT_MAIN in change and COMMIT_V2 in change


def test_python_engine_takes_a_hub_id_and_a_revision(offline_cache):
    from rollout_cli import Engine, SamplingParams

    params = SamplingParams(n=2, max_new_tokens=4, seed=3)
    prompts = ["What is 2 + 3?", "Name a color."]
    engine = Engine(model=HUB_ID, revision="v2", device="cpu")
    assert engine.config.model_source == HubSource(HUB_ID, "v2", COMMIT_V2)
    by_id = [t.response_token_ids for t in engine.generate(prompts, params)]
    by_dir = Engine(model=str(offline_cache["snapshots"][COMMIT_V2]), device="cpu").generate(prompts, params)
    assert by_id == [t.response_token_ids for t in by_dir]


def test_python_reload_weights_takes_a_hub_id_and_a_revision(offline_cache):
    from rollout_cli import Engine, SamplingParams

    params = SamplingParams(n=1, max_new_tokens=4, seed=3)
    engine = Engine(model=HUB_ID, device="cpu")  # main
    assert engine.reload_weights(HUB_ID, revision="v2") == "1"
    reloaded = [t.response_token_ids for t in engine.generate(["Name a color."], params)]
    by_dir = Engine(model=str(offline_cache["snapshots"][COMMIT_V2]), device="cpu").generate(["Name a color."], params)
    assert reloaded == [t.response_token_ids for t in by_dir]
    with pytest.raises(RolloutError, match="neither a local directory nor a valid hub id"):
        engine.reload_weights("not a/valid id/x")
    assert engine.weight_version == "1"
