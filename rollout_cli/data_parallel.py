"""Data parallelism for `rollout run`: N engine replicas, one input Parquet, one output directory.

The replicas are started and watched by torch's own launcher (torchrun / torch.distributed.run),
not by a scheduler of ours: `rollout run --dp N` starts N local replicas through it, and
`torchrun --nnodes M --nproc-per-node N -m rollout_cli.cli.main run ...` spreads them over
machines the same way. A process that torchrun started (WORLD_SIZE and RANK in its environment)
is a replica: it joins a gloo process group, generates the prompts whose index is its rank modulo
the world size, writes shards named part-rRRR-NNNNN.parquet, and replica 0 writes the manifest.

Sampling is keyed by (seed, prompt, sample, position), so the rows do not depend on how the
prompts were split: the union over replicas equals a one-replica run, and --resume works with
any replica count.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rollout_cli.errors import INTERRUPTED, RolloutError

# Set by launch_replicas for the processes it starts: a replica's one-line error goes into this folder
# (a file per rank, cli/errors.fail) and the launcher prints each distinct one once, instead of N
# replicas printing the same bad row N times.
REPLICA_ERRORS_ENV = "ROLLOUT_REPLICA_ERRORS"
# A tensor-parallel rank that left because another rank failed first exits with PEER_FAILED, silently;
# the rank that failed first writes its exit code into CLAIMED_EXIT_FILE of that folder: the code the
# launcher returns, whichever exit torchrun saw first (cli/rank_failure.py)
PEER_FAILED = 3
CLAIMED_EXIT_FILE = "claimed_exit_code"


@dataclass(frozen=True)
class ReplicaGroup:
    """This process's place among the replicas, and the collectives run_job needs.

    `ReplicaGroup()` is one process alone (no --dp, no torchrun): it owns every prompt and its
    collectives return at once, so run_job reads the same with data parallelism and without.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    process_group: object = None  # the collectives' group: None is WORLD (--dp); the engines' leaders (--tp with --dp)

    @classmethod
    def from_environment(cls) -> ReplicaGroup:
        """The group torchrun set up for this process, or a group of one when it was not started as a replica."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in os.environ:
            return cls()
        import torch.distributed as dist  # heavy: torch, only in a replica

        if not dist.is_initialized():
            dist.init_process_group("gloo")  # MASTER_ADDR / MASTER_PORT come from torchrun
        return cls(rank=dist.get_rank(), size=dist.get_world_size(),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def alone(self) -> bool:
        """One process runs the whole job: its counts are the job's, its shards carry no replica number."""
        return self.size == 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def owns(self, prompt_index: int) -> bool:
        return prompt_index % self.size == self.rank

    def barrier(self) -> None:
        if self.alone:
            return
        import torch.distributed as dist  # heavy: torch, only in a replica

        dist.barrier(group=self.process_group)

    def gather(self, value) -> list:
        """Every replica's `value`, in rank order (on every replica)."""
        if self.alone:
            return [value]
        import torch.distributed as dist  # heavy: torch, only in a replica

        values = [None] * self.size
        dist.all_gather_object(values, value, group=self.process_group)
        return values

    def close(self) -> None:
        if self.alone:
            return
        import torch.distributed as dist  # heavy: torch, only in a replica

        if dist.is_initialized():
            dist.destroy_process_group()


def replica_device(device: str, group: ReplicaGroup) -> str:
    """Each local replica takes its own GPU: "auto"/"cuda" -> cuda:LOCAL_RANK; the CPU is shared.
    A process alone keeps the device it was given."""
    if group.alone:
        return device
    import torch  # heavy, and only a replica gets here

    if device in ("auto", "cuda") and torch.cuda.is_available():
        if group.local_rank >= torch.cuda.device_count():
            raise RolloutError(f"replica {group.rank} wants GPU {group.local_rank}, but this machine has "
                               f"{torch.cuda.device_count()}; lower --dp / --nproc-per-node")
        return f"cuda:{group.local_rank}"
    if device.startswith("cuda:"):
        raise RolloutError("--device cuda:N pins every replica to one GPU; use --device cuda (one GPU per replica)")
    return device


def launch_replicas(count: int, run_args: list[str], what: str = "data-parallel replica", command: str = "run") -> int:
    """Run `rollout COMMAND RUN_ARGS` as `count` local processes under torch.distributed.run (replicas, or
    tensor-parallel ranks of run, bench and serve); returns the exit code (128 + N after signal N)."""
    # heavy: torch, only in the command that starts the processes
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    threads = max(1, (os.cpu_count() or 1) // count)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # else torchrun sets 1 and warns
    args = get_args_parser().parse_args(
        ["--standalone", "--nnodes", "1", "--nproc-per-node", str(count), "--module", "rollout_cli.cli.main"]
    )
    # set after parsing: torchrun's parser would read `--n 4` of the run arguments as its own abbreviation
    args.training_script_args = [command, *run_args]
    _quiet_launcher_logs()
    errors = tempfile.mkdtemp(prefix="rollout-replica-errors-")
    os.environ[REPLICA_ERRORS_ENV] = errors
    try:
        run(args)
    except SignalException as err:  # SIGINT / SIGTERM to the launcher: it passed the signal on to every process
        if command == "run":
            print(INTERRUPTED, file=sys.stderr)
        return 128 + int(err.sigval)
    except Exception as err:  # torch's ChildFailedError
        failures = getattr(err, "failures", None) or {}
        code = _failing_code([f.exitcode for f in failures.values()], errors)
        messages = replica_errors(errors)
        for message in messages:  # the replicas' own one-line errors (a bad row: the same line from each)
            print(f"error: {message}", file=sys.stderr)
        if not messages:  # a crash: its traceback is above
            hint = " Finished rows are kept: fix the cause and run again with --resume" if command == "run" else ""
            print(f"error: a {what} failed (exit {code}); its error is above.{hint}", file=sys.stderr)
        return code
    finally:
        os.environ.pop(REPLICA_ERRORS_ENV, None)
        shutil.rmtree(errors, ignore_errors=True)
    return 0


def _failing_code(codes: list[int], folder: str) -> int:
    """The command's exit code: the claimed one (the rank that failed first), else the failing processes'
    own, not that of a peer that left after it (PEER_FAILED) or that the launcher stopped (130, or -15)."""
    claimed = Path(folder) / CLAIMED_EXIT_FILE
    if claimed.is_file():
        return int(claimed.read_text())
    codes = sorted({c for c in codes if c != PEER_FAILED})
    return ([c for c in codes if c > 0 and c != 130] or [c for c in codes if c > 0] or [1])[0]


def replica_errors(folder: str) -> list[str]:
    """The distinct one-line errors the replicas left in `folder`, in rank order."""
    messages = [path.read_text() for path in sorted(Path(folder).glob("*.txt"), key=lambda p: int(p.stem))]
    return list(dict.fromkeys(messages))


def _quiet_launcher_logs() -> None:
    """torchrun logs a failed replica's exit code as an ERROR line with a timestamp and a pid; the
    launcher says it once in rollout's words instead (launch_replicas)."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def without_option(argv: list[str], name: str) -> list[str]:
    """argv minus `--name VALUE` / `--name=VALUE` (the replicas must not launch replicas)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == name:
            skip = True
            continue
        if arg.startswith(name + "="):
            continue
        out.append(arg)
    return out
