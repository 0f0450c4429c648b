"""ImageRows (the images `rollout score` and `--continue-aborted` read back from a run's prompt file)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_cli.errors import RolloutError
from rollout_cli.io.image_rows import ImageRows


def test_a_text_column_named_as_the_image_column_is_one_line(tmp_path):
    """`rollout score --image-key data_source`: the column holds text, said once for the file, not a missing
    file per prompt; a real path column of the same file reads."""
    (tmp_path / "one.png").write_bytes(b"not decoded here")
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"data_source": ["arithmetic", "arithmetic"], "image": ["one.png", "one.png"]}), path)
    with pytest.raises(RolloutError, match=r"column 'data_source' of .* holds strings, not images \(row 0"):
        ImageRows(path, "data_source").cell(1)
    assert ImageRows(path, "image").cell(1) == "one.png"
