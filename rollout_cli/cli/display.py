"""What the job commands draw on stderr: rich progress bars while they run, a summary table at the end.

`rollout run` draws the same bar and table whichever launcher ran the job (embedded, tensor-parallel
ranks, a daemon); `rollout score` has its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


class RunProgressBar:
    """A rich bar: prompts done / total, output tokens/s, ETA; `with RunProgressBar(console) as update:`.

    Started by the first update (run_job sends one once every row validated), so a
    bad input ends with the one `error:` line alone, not a bar drawn above it.
    `update` takes anything with run_job's JobProgress counters (a daemon's progress events too).
    """

    def __init__(self, console: Console):
        self.progress = Progress(
            TextColumn("[bold]prompts"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[tps]:>9.0f} out tok/s"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=console, transient=False,
        )
        self.task = None

    def __enter__(self) -> Callable[[object], None]:
        return self.update

    def update(self, state) -> None:
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task("generate", total=None, tps=0.0)
        self.progress.update(self.task, total=state.prompts_total, completed=state.prompts_done,
                             tps=state.output_tokens_per_s)

    def __exit__(self, *exc):
        if self.task is not None:
            self.progress.stop()
        return False


def run_summary_table(manifest: dict, out: str) -> Table:
    """`rollout run`'s closing table, from the job's final manifest."""
    table = Table(title=f"rollout run -> {Path(out)}", show_header=False)
    rows = [
        ("status", manifest["status"]),
        ("prompts", f"{manifest['prompts_done']} / {manifest['prompts']}"),
        ("trajectories", str(manifest["trajectories"])),
        ("written this run", str(manifest["trajectories_this_run"])),
        ("output tokens/s", f"{manifest['output_tokens_per_s']:.1f}"),
        ("prefix hit rate", f"{manifest['prefix_hit_rate']:.1%}"),
        ("finish reasons", ", ".join(f"{k}: {v}" for k, v in manifest["finish_reasons_this_run"].items()) or "-"),
        ("skipped rows", str(len(manifest["skipped_rows"]))),
        ("wall time", f"{manifest['wall_seconds']:.1f} s"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


@contextlib.contextmanager
def score_progress_bar(console: Console) -> Iterator[Callable[[object], None]]:
    """A rich bar: samples scored / total, tokens/s; yields the update function for run_score_job."""
    progress = Progress(TextColumn("[bold]samples"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[tps]:>9.0f} tok/s"), TimeElapsedColumn(), console=console)
    with progress:
        task = progress.add_task("score", total=None, tps=0.0)
        yield lambda p: progress.update(task, total=p.samples_total, completed=p.samples_done, tps=p.tokens_per_s)


def score_summary_table(manifest: dict, out: str) -> Table:
    """`rollout score`'s closing table, from the score job's final manifest."""
    table = Table(title=f"rollout score -> {Path(out)}", show_header=False)
    rows = [("status", manifest["status"]), ("samples", str(manifest["samples"])),
            ("tokens scored", str(manifest["tokens"]))]
    if manifest["tokens"]:
        rows += [
            ("|run - score| mean / p99 / max",
             f"{manifest['mean_abs_diff']:.3g} / {manifest['p99_abs_diff']:.3g} / {manifest['max_abs_diff']:.3g}"),
            ("bit-for-bit equal", f"{manifest['bitwise_equal_tokens']:.1%} of tokens, "
                                  f"{manifest['bitwise_equal_samples']} of {manifest['samples']} samples"),
        ]
    rows.append(("wall time", f"{manifest['wall_seconds']:.1f} s"))
    for key, value in rows:
        table.add_row(key, value)
    return table
