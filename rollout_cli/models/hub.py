"""Hub model ids: `--model Qwen/Qwen3-8B` resolved to a snapshot directory of the Hugging Face cache.

One resolution point for every command and the Python API: `resolve_engine_config` turns an
EngineConfig whose model is a hub id into one whose model is the snapshot directory, with the id,
the revision asked for and the commit it resolved to in `model_source` (the run manifest records
them; --resume compares the commit). Everything after it reads a local directory, as before.

A local directory always wins over a hub id of the same spelling. The cache is huggingface_hub's
own (HF_HOME, HF_HUB_CACHE), so a model fetched by transformers, vLLM or `hf download` is reused;
HF_HUB_OFFLINE=1 reads the cache alone. Only the files the engine reads are fetched.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_cli.data_parallel import without_option
from rollout_cli.errors import RolloutError

if TYPE_CHECKING:
    from rollout_cli.config import EngineConfig

DEFAULT_REVISION = "main"
# What the engine reads (models/build.py, models/loader.py, engine/tokenizer.py): the config, safetensors
# weights and their index, tokenizer and chat-template files, processor configs. Pickle weights (*.bin,
# *.pt, *.pth), gguf, onnx and the like are never fetched: they match none of these.
CONFIG_PATTERNS = ("config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json")
TOKENIZER_PATTERNS = ("tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                      "chat_template*", "*.tiktoken")
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
# The loader reads the top of the snapshot only; fnmatch's * also matches "/", so without this
# original/*.safetensors or onnx/ folders of some repos would come along.
IGNORE_PATTERNS = ("*/*",)
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubSource:
    """Which hub weights ran: recorded in the manifest, compared by --resume."""

    hub_id: str
    """The id as typed, e.g. Qwen/Qwen3-8B."""
    revision: str
    """The branch, tag or commit asked for (--revision; main by default)."""
    commit: str
    """The commit the revision resolved to: the snapshot directory's name in the cache."""

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ResolvedModel:
    """A checkpoint directory to load, and the hub snapshot it is (None: a local directory)."""

    path: str
    source: HubSource | None = None


def allow_patterns(weights: bool = True) -> list[str]:
    """Files fetched for a hub id; without weights (--load-format dummy) the config and tokenizer alone."""
    return [*CONFIG_PATTERNS, *TOKENIZER_PATTERNS, *(WEIGHT_PATTERNS if weights else ())]


def resolve_engine_config(config: EngineConfig, quiet: bool = False) -> EngineConfig:
    """The config with a hub id replaced by its snapshot directory (`model_source` says which); a config
    whose model is a local directory, or that was resolved already, comes back unchanged."""
    if config.model_source is not None:
        return config
    resolved = resolve_model(config.model, config.revision, weights=config.load_format != "dummy", quiet=quiet)
    if resolved.source is None:
        return config
    return dataclasses.replace(config, model=resolved.path, model_source=resolved.source)


def resolve_model(model: str, revision: str | None = None, *, weights: bool = True, quiet: bool = False,
                  what: str = "--model") -> ResolvedModel:
    """A local directory as is; else a hub id fetched into (or found in) the Hugging Face cache.
    `what` names the argument in errors (reload-weights' CHECKPOINT is not --model)."""
    if os.path.isdir(model):
        if revision is not None:  # the directory shadows the id: say so rather than ignore --revision
            raise RolloutError(f"--revision {revision} selects a version of a hub id, but {model} is a local "
                               "directory (a local directory wins over a hub id of the same name); drop "
                               "--revision, or rename the directory")
        return ResolvedModel(model)
    hub_id = _checked_hub_id(model, what)
    revision = revision or DEFAULT_REVISION
    path = _snapshot(hub_id, revision, weights, quiet, what)
    # a cache snapshot lives in snapshots/<commit>/: its name is the commit the revision resolved to
    return ResolvedModel(path, HubSource(hub_id, revision, os.path.basename(os.path.normpath(path))))


def _checked_hub_id(model: str, what: str) -> str:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise RolloutError(
            f"{what} {model!r} is neither a local directory nor a valid hub id (ORG/NAME of letters, digits, "
            "'-', '_' and '.'); pass a checkpoint directory or a hub id such as Qwen/Qwen3-8B"
        ) from None
    return model


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _snapshot(hub_id: str, revision: str, weights: bool, quiet: bool, what: str) -> str:
    """snapshot_download with the engine's files, errors turned into one line that names the fix."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                       RepositoryNotFoundError, RevisionNotFoundError, disable_progress_bars)

    described = f"{hub_id} (revision {revision})"
    kwargs = dict(revision=revision, allow_patterns=allow_patterns(weights), ignore_patterns=list(IGNORE_PATTERNS))
    offline = _offline()
    if not offline and _COMMIT.fullmatch(revision):
        # a commit never moves: a complete cached snapshot needs no network (and draws no bars: the
        # ranks of --tp and --dp, pinned to the commit their launcher resolved, find it here)
        try:
            return snapshot_download(hub_id, local_files_only=True, **kwargs)
        except LocalEntryNotFoundError:
            pass
    try:
        if quiet:  # the hub's own tqdm bars on stderr are the download's progress; --quiet silences them
            disable_progress_bars()
        return snapshot_download(hub_id, local_files_only=offline, **kwargs)
    except RevisionNotFoundError:
        raise RolloutError(f"{hub_id} has no revision {revision!r}; pass --revision with one of its branches, "
                           "tags or commits") from None
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise RolloutError(
            f"{what} {hub_id} is not a local directory, and the hub refused it as an id ({type(err).__name__}: not "
            "found, private or gated); check the path or id, or log in (hf auth login, or HF_TOKEN) for a private "
            "or gated model") from None
    except LocalEntryNotFoundError as err:
        if type(err).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 1.x knows a partial snapshot
            raise RolloutError(f"{described} is only partly in the Hugging Face cache {_cache_dir()} (an interrupted "
                               "download); run again online to complete it") from None
        if offline:
            # also what a mistyped local path gets offline, hence "neither a local directory"
            raise RolloutError(
                f"{what} {described} is neither a local directory nor in the Hugging Face cache {_cache_dir()}, "
                "and HF_HUB_OFFLINE=1 forbids downloading it; download it once online (unset HF_HUB_OFFLINE), "
                "or check the path of a local checkpoint") from None
        raise RolloutError(
            f"cannot reach the Hugging Face hub for {described}, and it is not in the cache {_cache_dir()}; check "
            f"the network (or HF_ENDPOINT), or pass {what} DIR of a local checkpoint") from None
    except HfHubHTTPError as err:
        raise RolloutError(f"the hub failed fetching {described}: {str(err).splitlines()[0]}; retry later, "
                           f"or pass {what} DIR of a local checkpoint") from None
    except OSError as err:  # disk full, cache not writable
        raise RolloutError(f"cannot write {described} into the Hugging Face cache {_cache_dir()} ({err}); free "
                           "space, or point HF_HOME at a writable directory") from None


def pinned_argv(argv: list[str], config: EngineConfig) -> list[str]:
    """argv for the processes a command re-starts (--dp replicas, --tp ranks): a hub id pinned to the
    commit resolved here, so every process loads the same weights even if the branch moves meanwhile."""
    if config.model_source is None:
        return argv
    return [*without_option(argv, "--revision"), "--revision", config.model_source.commit]


def source_change(previous: dict | None, current: dict | None) -> str | None:
    """How two manifests' model_source differ, in a few words: None when the commits agree or either
    run read a local directory (the checkpoint fingerprint compares the content then)."""
    if not previous or not current or previous.get("commit") == current.get("commit"):
        return None
    return (f"the run read {previous.get('hub_id')} at commit {previous.get('commit')} (revision "
            f"{previous.get('revision')}), this one {current.get('hub_id')} at commit {current.get('commit')} "
            f"(revision {current.get('revision')})")
