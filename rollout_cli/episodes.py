"""`rollout run --env FILE`: multi-turn episodes in batch, a model turn and an environment turn at a time.

An environment file defines `make_env(row) -> environment`, where `row` is the prompt row's other
columns (the passthrough) and `prompt_token_ids`; the environment's `step(turn: ModelTurn) -> EnvStep`
answers each model turn with an observation (text, tokenized as it is with no special tokens added,
or token ids), a reward, and whether the episode is done. The environment owns the format of its
observations (the chat template's turn markers included): the engine appends exactly those tokens, so
nothing is re-tokenized between turns and the trainer sees the tokens the model saw.

Every episode is a sample (prompt_index, sample_index) of the job, `--n` per prompt. Its turns run as
requests in the engine's one stream, interleaved with every other episode's: when a model turn ends
the environment answers it, and the next turn (the conversation so far as its prompt, continuing the
sample's random stream at its positions) is queued at once. The conversation's KV stays pinned between
turns (engine/scheduling/sessions.py), so a turn prefills only its new tokens. An episode ends when the environment
says done, after `--max-turns` model turns, or when the conversation reaches --max-model-len; its row
holds the whole conversation after the prompt, with a loss mask (1 model tokens, 0 environment tokens).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import operator
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.scheduling.request_maker import sample_slices, token_id_problem
from rollout_cli.engine.scheduling.sessions import Sessions
from rollout_cli.engine.trajectory import NO_PROMPT_YET, PartialSample, PromptInput, Trajectory
from rollout_cli.episode_room import EpisodeRoom
from rollout_cli.errors import RolloutError

# Episodes keep their pins for as long as they run; the retention time only matters to the daemon.
EPISODE_RETENTION_SECONDS = float("inf")


@dataclass(frozen=True)
class ModelTurn:
    """What the environment sees of one model turn."""

    text: str  # the turn's tokens decoded (special tokens skipped), cut at its stop rule (stop_text.py)
    token_ids: list[int]
    finish_reason: str  # "stop" (eos, a stop token id or the completion of a --stop string: the last id) or "length"
    turn: int  # 0 for the first model turn


@dataclass
class EnvStep:
    """The environment's answer to a model turn."""

    observation: str | list[int] | None = None  # appended after the model's turn; None or "" adds nothing
    reward: float = 0.0
    done: bool = False


def load_environment(path: str) -> Callable[[dict], Any]:
    """The `make_env` of an environment file; one line on anything wrong with it."""
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "no such file"
        raise RolloutError(f"--env {path}: {what}; pass a Python file that defines make_env(row)")
    spec = importlib.util.spec_from_file_location(f"rollout_env_{abs(hash(os.path.abspath(path)))}", path)
    if spec is None or spec.loader is None:  # importlib finds no loader for a name not ending in .py
        raise RolloutError(f"--env {path} is not a Python file; the env file must be a Python file (.py) "
                           "defining make_env(row)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - the user's file: say which and why, in one line
        raise RolloutError(f"--env {path} failed to import: {type(err).__name__}: {err}") from err
    except BaseException as err:
        raise _exited(f"{path} on import", err) from err
    make_env = getattr(module, "make_env", None)
    if not callable(make_env):
        raise RolloutError(f"--env {path} defines no make_env(row) function; see recipes/envs/calculator.py")
    return make_env


@dataclass
class Episode:
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    env: Any
    passthrough: dict
    params: SamplingParams  # of each model turn: the row's (or the job's), n = 1
    response: list[int] = field(default_factory=list)  # everything after the prompt: model and env tokens
    logprobs: list[float] = field(default_factory=list)  # 0.0 at environment tokens
    loss_mask: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    model_turns: list[list[int]] = field(default_factory=list)  # [start, end) in `response` of each model turn
    turn_cached_tokens: list[int] = field(default_factory=list)  # per model turn: prompt tokens the cache served
    reward: float = 0.0
    finish_reason: str = ""  # done, max_turns, length or abort, once it ended
    ttft_seconds: float = 0.0  # the first turn's: queueing to the first model token
    images: tuple = ()  # the prompt row's images (vision-language models): every turn's prompt holds them

    @property
    def key(self) -> tuple[int, int]:
        return self.prompt_index, self.sample_index

    @property
    def session_id(self) -> str:
        return f"episode-{self.prompt_index}-{self.sample_index}"

    def next_turn(self, previous_prompt_len: int) -> PartialSample:
        """The next model turn: the conversation so far is its prompt."""
        return PartialSample(self.prompt_index, self.sample_index, self.prompt_token_ids + self.response, [], [], [],
                             self.passthrough, self.params, conversation=previous_prompt_len, images=self.images)


def _user_call(what: str, fn, *args):
    """Call the --env file's code: what it raises becomes one line naming the call, not a traceback."""
    try:
        return fn(*args)
    except RolloutError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's code: say where and why, in one line
        raise RolloutError(f"--env {what} raised {type(err).__name__}: {err}; fix the environment or the "
                           "rows it reads") from err
    except BaseException as err:
        raise _exited(what, err) from err


def _exited(what: str, err: BaseException) -> RolloutError:
    """sys.exit() or another BaseException from the env's code, as one line. Let through, it would end an
    embedded run with exit 0 and kill the daemon's worker thread (every later command hanging). A
    KeyboardInterrupt on the main thread may be a real Ctrl-C or SIGTERM (cli/errors.py): it still stops the run."""
    if isinstance(err, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
        raise err
    code = f" {err.code}" if isinstance(err, SystemExit) else ""
    return RolloutError(f"--env {what} exited ({type(err).__name__}{code}); an environment must return, "
                        "not exit: fix the environment")


def _step_answer(step, what: str) -> tuple[float, Any]:
    """A step's reward as a float, and its observation checked for type; one line naming the row else."""
    if not isinstance(step, EnvStep):
        raise RolloutError(f"the environment's step returned {type(step).__name__}; return an EnvStep")
    try:
        reward = float(step.reward)
    except (TypeError, ValueError):
        reward = math.nan
    if not math.isfinite(reward):  # a NaN reward would reach the trainer's advantages
        raise RolloutError(f"--env {what} returned reward {_short(step.reward)}, not a finite number; "
                           "return EnvStep(reward=<float>)")
    observation = step.observation
    if observation is None or isinstance(observation, str):
        return reward, observation
    try:  # token ids: a list, a tuple, an array of ints
        ids = list(observation)
    except TypeError:
        ids = None
    if ids is None or not all(_is_token_id(t) for t in ids):
        raise RolloutError(f"--env {what} returned observation {_short(observation)}; return text, "
                           "a list of int token ids, or None")
    return reward, ids


def _is_token_id(value) -> bool:
    try:
        return not isinstance(value, bool) and operator.index(value) == value
    except TypeError:
        return False


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


DEFAULT_MAX_TURNS = 8  # `rollout run --env` and the daemon's jobs: model turns per episode at most


def check_max_turns(max_turns: int) -> None:
    """--max-turns: the CLI and the daemon check it before OUT exists (JobConfig), Python callers here."""
    if max_turns < 1:
        raise RolloutError(f"--max-turns must be at least 1, got {max_turns}")


def check_episode_sampling(params) -> None:
    """Sampling settings an episode job cannot honour yet, refused in one line."""
    if params.top_logprobs:
        raise RolloutError("--top-logprobs is not supported with --env yet (an episode's response mixes model and "
                           "environment tokens); drop one of them")
    if params.return_sampling_mask:
        raise RolloutError("--sampling-mask is not supported with --env yet (an episode's response mixes model and "
                           "environment tokens); drop one of them")


class EpisodeRunner:
    """Runs a job's samples as episodes; `stream` has Engine.stream's signature and yields one
    Trajectory per finished episode, its `episode` columns filled."""

    def __init__(self, engine, make_env: Callable[[dict], Any], max_turns: int):
        check_max_turns(max_turns)
        self.engine = engine
        self.make_env = make_env
        self.max_turns = max_turns
        self.sessions = Sessions(EPISODE_RETENTION_SECONDS)
        self.sessions.fit_pool(engine.num_kv_slots)
        # episodes start while their projected KV fits the pool
        self.room = EpisodeRoom(engine.num_kv_slots, max_turns, engine.requests.max_model_len)
        self.turns = self.turn_prompt_tokens = self.turn_cached_tokens = 0

    def summary(self) -> dict:
        """What the manifest records of the episodes' turns: how much each turn's prompt came from the cache."""
        return {"turns": self.turns, "turn_prompt_tokens": self.turn_prompt_tokens,
                "turn_cached_tokens": self.turn_cached_tokens,
                "prefix_hit_rate": round(self.turn_cached_tokens / self.turn_prompt_tokens, 4)
                if self.turn_prompt_tokens else 0.0, **self.room.summary()}

    def stream(self, prompts: Iterable[PromptInput | PartialSample], params: SamplingParams,
               skip=frozenset(), on_step=None) -> Iterator[Trajectory]:
        limit = 2 * self.engine.config.max_running  # episodes started ahead of the engine's room
        rows = iter(sample_slices(prompts, params, limit))  # a row of many samples: its episodes a slice at a time
        ready: deque[PromptInput | PartialSample] = deque()  # turns to queue: a row's first ones, or an episode's next
        active: dict[tuple[int, int], Episode] = {}
        finished: deque[Trajectory] = deque()
        exhausted, pending = False, None  # pending: the next row, read but waiting for room

        def source():
            nonlocal exhausted, pending
            while True:
                if ready:
                    yield ready.popleft()
                    continue
                if pending is None and not exhausted and len(active) < limit:
                    pending = next(rows, None)
                    exhausted = pending is None
                if pending is not None and len(active) < limit and self.room.fits_row(pending, params):
                    ready.extend(self._start(pending, params, skip, active))
                    pending = None
                elif active:
                    yield NO_PROMPT_YET  # turns in flight: their episodes go on once they finish
                elif pending is None:
                    return

        try:
            for turn in self.engine.stream(source(), params, skip=skip, on_step=on_step):
                episode = active[(turn.prompt_index, turn.sample_index)]
                follow_up = self._after_turn(episode, turn)
                if follow_up is None:
                    del active[episode.key]
                    self.room.closed(episode.key, len(episode.model_turns))
                    self.sessions.close(self.engine.scheduler, episode.session_id)
                    finished.append(self._trajectory(episode, turn))
                else:
                    ready.append(follow_up)
                while finished:
                    yield finished.popleft()
        finally:
            for episode in active.values():
                self.sessions.close(self.engine.scheduler, episode.session_id)

    def _start(self, row: PromptInput | PartialSample, params: SamplingParams, skip, active) -> list[PromptInput]:
        """A prompt row's episodes (but those in `skip`); -> the row itself, whose n first turns run as
        one group (the first computes the prompt, the others read it from the cache)."""
        if isinstance(row, PartialSample):
            return [self._resume(row, params, active)]
        params, opened = row.params or params, len(active)
        turn_params = dataclasses.replace(params, n=1)  # each later turn is one request of its episode
        samples = range(params.n) if row.samples is None else row.samples  # the row's, or its slice's
        for sample in samples:
            if (row.prompt_index, sample) in skip:
                continue
            env = _user_call(f"make_env(row) on row {row.prompt_index}", self.make_env,
                             {**row.passthrough, "prompt_token_ids": list(row.prompt_token_ids)})
            if not callable(getattr(env, "step", None)):
                raise RolloutError(f"--env make_env(row) returned {type(env).__name__}, which has no step(turn) "
                                   "method; return an environment object (see recipes/envs/calculator.py)")
            episode = Episode(row.prompt_index, sample, list(row.prompt_token_ids), env, row.passthrough, turn_params,
                              images=tuple(row.images))
            active[episode.key] = episode
            self.room.opened(episode.key, len(row.prompt_token_ids) / len(samples), params.max_new_tokens)  # shared
        return [dataclasses.replace(row, params=params, conversation=0)] if len(active) > opened else []

    def _resume(self, row: PartialSample, params: SamplingParams, active) -> PartialSample:
        """An aborted episode (--continue-aborted): a fresh environment replays the episode's finished model
        turns (its answers must be the observations the row holds: continuing needs an environment whose
        answers depend only on the model's turns), then the aborted turn continues from its tokens so far."""
        if row.episode is None:
            raise RolloutError(f"--env --continue-aborted: the aborted sample {row.prompt_index}/{row.sample_index} "
                               "was not written by an --env run; continue it without --env")
        where = f"row {row.prompt_index}"
        env = _user_call(f"make_env(row) on {where}", self.make_env,
                         {**row.passthrough, "prompt_token_ids": list(row.prompt_token_ids)})
        response, turns = list(row.response_token_ids), [list(span) for span in row.episode["model_turns"]]
        last = turns[-1][0]  # where the aborted turn starts: everything before it is replayed
        episode = Episode(row.prompt_index, row.sample_index, list(row.prompt_token_ids), env, row.passthrough,
                          dataclasses.replace(row.params or params, n=1), response[:last],
                          list(row.response_logprobs[:last]), list(row.episode["response_loss_mask"][:last]),
                          list(row.response_weight_versions[:last]), turns[:-1],
                          list(row.episode["turn_cached_tokens"][:-1]), images=tuple(row.images))
        for k, (start, end) in enumerate(turns[:-1]):
            ids = response[start:end]
            finish, text = self.engine.requests.replayed_turn(ids, episode.params, self.engine.decode)  # as it ended
            step = _user_call(f"the environment's step on {where}", env.step, ModelTurn(text, ids, finish, k))
            reward, observation = _step_answer(step, f"the environment's step on {where}")
            if step.done or self._observation_ids(observation) != response[end:turns[k + 1][0]]:
                raise RolloutError(f"--continue-aborted: the environment answered model turn {k} of {where} "
                                   "differently on replay; continuing an episode needs an environment whose answers "
                                   "depend only on the model's turns (drop --continue-aborted to keep the row)")
            episode.reward += reward
        active[episode.key] = episode
        self.room.opened(episode.key, len(episode.prompt_token_ids) + last, episode.params.max_new_tokens,
                         len(turns) - 1)
        previous = len(row.prompt_token_ids) + turns[-2][0] if len(turns) > 1 else 0
        return PartialSample(row.prompt_index, row.sample_index, episode.prompt_token_ids + episode.response,
                             response[last:], list(row.response_logprobs[last:]), list(row.response_weight_versions[last:]),
                             row.passthrough, episode.params, conversation=previous, images=episode.images)

    def _after_turn(self, episode: Episode, turn: Trajectory) -> PartialSample | None:
        """Record a finished model turn and let the environment answer it; -> the next turn, or None
        when the episode ended (its finish reason set in episode.finish_reason)."""
        start = len(episode.response)
        ids = turn.response_token_ids
        episode.response += ids
        episode.logprobs += turn.response_logprobs
        episode.loss_mask += [1] * len(ids)
        episode.versions += turn.response_weight_versions
        episode.model_turns.append([start, start + len(ids)])
        episode.turn_cached_tokens.append(turn.cached_prompt_tokens)
        if start == 0:
            episode.ttft_seconds = turn.ttft_seconds
        self.turns += 1
        self.turn_prompt_tokens += len(turn.prompt_token_ids)
        self.turn_cached_tokens += turn.cached_prompt_tokens
        if turn.finish_reason == "abort":
            episode.finish_reason = "abort"
            return None
        # pinned by its cache key: image placeholder tokens are cached under their pixels' digest
        self.sessions.turn_finished(self.engine.scheduler, episode.session_id,
                                    self.engine.cache_key(turn.prompt_token_ids, episode.images), ids,
                                    turn.cached_prompt_tokens)
        what = f"the environment's step on row {episode.prompt_index}"
        step = _user_call(what, episode.env.step,
                          ModelTurn(turn.response_text, list(ids), turn.finish_reason, len(episode.model_turns) - 1))
        reward, observation = _step_answer(step, what)
        episode.reward += reward
        if step.done:
            episode.finish_reason = "done"
            return None
        if len(episode.model_turns) >= self.max_turns:
            episode.finish_reason = "max_turns"
            return None
        # an observation is kept only when a model turn follows it
        observation = self._observation_ids(observation)
        if len(episode.prompt_token_ids) + len(episode.response) + len(observation) > self.engine.requests.max_prompt_len:
            episode.finish_reason = "length"  # no room left for a model token under --max-model-len
            return None
        episode.response += observation
        episode.logprobs += [0.0] * len(observation)
        episode.loss_mask += [0] * len(observation)
        episode.versions += [turn.weight_version] * len(observation)
        self.room.continued(episode.key, len(ids) + len(observation))
        return episode.next_turn(len(turn.prompt_token_ids))

    def _observation_ids(self, observation) -> list[int]:
        if observation is None or observation == "":
            return []
        if isinstance(observation, str):
            tokenizer = self.engine.tokenizer
            if tokenizer is None:
                raise RolloutError("the environment answered with text but the model has no tokenizer files; "
                                   "answer with token ids")
            return [int(t) for t in tokenizer.encode(observation, add_special_tokens=False)]
        ids = [int(t) for t in observation]
        problem = token_id_problem(ids, self.engine.requests.vocab_size) if ids else None
        if problem is not None:
            raise RolloutError(f"the environment answered with token id {problem[1]}, outside the model's "
                               f"vocabulary [0, {self.engine.requests.vocab_size})")
        return ids

    def _trajectory(self, episode: Episode, last: Trajectory) -> Trajectory:
        """The episode's row. With routing capture its routing is the last turn's: that turn's prompt is the
        conversation before it, so its routing covers every position of the episode but the last token
        (earlier turns' and observations' positions from the pinned prefix, whose KV slots keep theirs)."""
        routing = last.routed_experts
        if routing is not None:
            assert last.prompt_token_ids + last.response_token_ids == episode.prompt_token_ids + episode.response
            assert routing.shape[0] == len(episode.prompt_token_ids) + len(episode.response) - 1
        return Trajectory(
            prompt_index=episode.prompt_index, sample_index=episode.sample_index,
            prompt_token_ids=episode.prompt_token_ids, response_token_ids=episode.response,
            response_logprobs=episode.logprobs, response_text=self.engine.decode(episode.response),
            finish_reason=episode.finish_reason, weight_version=last.weight_version,
            response_weight_versions=episode.versions, passthrough=episode.passthrough,
            ttft_seconds=episode.ttft_seconds, routed_experts=routing,
            image_grid_thw=[list(im.grid_thw) for im in episode.images] if episode.images else None,
            episode={"response_loss_mask": episode.loss_mask, "model_turns": episode.model_turns,
                     "episode_reward": episode.reward, "turn_cached_tokens": episode.turn_cached_tokens},
        )
