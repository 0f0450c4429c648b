"""The images of a run's prompt rows, looked up by prompt index: what `rollout score` pairs with the
trajectories of an image run (they hold the placeholder tokens and grids, not the pixels).

The run's prompt file is read a row group at a time (its image column only) and the last few row groups
are kept: trajectories come out roughly in prompt order, so a million-row file is never in memory.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rollout_cli.errors import RolloutError, one_line
from rollout_cli.io.image_cells import refuse_text_cells

_KEPT_ROW_GROUPS = 4


class ImageRows:
    """Image cells of one Parquet file's rows (`cell(row)`), and the folder relative image paths start from."""

    def __init__(self, path: str | Path, image_key: str):
        self.path = Path(path)
        if not self.path.is_file():
            raise RolloutError(f"the run's prompt file {self.path} (for its images) does not exist; pass the file "
                               "with --images-from")
        try:
            self._file = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as err:
            raise RolloutError(f"{self.path} is not a readable Parquet file ({one_line(err)})") from err
        if image_key not in self._file.schema_arrow.names:
            raise RolloutError(f"{self.path} has no image column {image_key!r}; pass --image-key with the column "
                               "the run read its images from")
        self.image_key = image_key
        self.base_dir = self.path.parent
        metadata = self._file.metadata
        self._starts = [0]  # first row of each row group
        for g in range(metadata.num_row_groups):
            self._starts.append(self._starts[-1] + metadata.row_group(g).num_rows)
        self._groups: OrderedDict[int, list[Any]] = OrderedDict()

    def cell(self, row: int) -> Any:
        """The image cell of row `row` (0-based, the run's prompt_index)."""
        if not 0 <= row < self._starts[-1]:
            raise RolloutError(f"prompt_index {row} is past the {self._starts[-1]} rows of {self.path}; pass the "
                               "prompt file of the run that wrote these trajectories")
        group = bisect.bisect_right(self._starts, row) - 1
        if group not in self._groups:
            cells = self._file.read_row_group(group, columns=[self.image_key]).column(0).to_pylist()
            refuse_text_cells(cells, self._starts[group], self.path, self.image_key)  # --image-key naming text
            self._groups[group] = cells
            while len(self._groups) > _KEPT_ROW_GROUPS:
                self._groups.popitem(last=False)
        self._groups.move_to_end(group)
        return self._groups[group][row - self._starts[group]]
