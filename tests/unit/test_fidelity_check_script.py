"""scripts/fidelity_check.py (issue 19's table) on the CPU: one engine serves every comparison and both
modes (set_deterministic between them, a flushed prefix cache for a fresh engine), and in the on-policy
mode each comparison is exact: the same tokens and bit-equal logprobs, scoring included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_is_exact_in_the_on_policy_mode():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "fidelity_check.py"), "--model",
                           str(ROOT / "recipes" / "example_model"), "--device", "cpu", "--dtype", "float32",
                           "--num-prompts", "4", "--n", "2", "--output-len", "8"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("default", "deterministic"))]
    assert len(rows) == 8  # four comparisons in each mode
    deterministic = {" ".join(row[1:4]): row for row in rows if row[0] == "deterministic"}
    assert deterministic["alone vs batch"][4:] == ["2", "of", "2", "max", "0"]
    assert deterministic["rerun, cache on"][4:] == ["8", "of", "8", "max", "0"]
    assert deterministic["rerun, cache off"][4:] == ["8", "of", "8", "max", "0"]
    assert "bit-equal 100.0%" in " ".join(deterministic["score vs run"])
