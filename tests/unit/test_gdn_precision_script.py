"""scripts/gdn_precision.py (issue 25 item 5's accuracy study) keeps measuring what it says: its float32
and float64 chunked forwards agree with the repo's Gated DeltaNet reference, and on a small case the
policies order as the study found (float32 < tf32 < FLA's bf16 intermediates, all against float64)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gdn_precision.py"


def _script():
    spec = importlib.util.spec_from_file_location("gdn_precision", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_the_study_matches_the_reference_and_orders_the_policies():
    study = _script()
    check = study.check_against_repo(torch.Generator().manual_seed(0))  # asserts agreement itself
    assert set(check) == {"float32", "float64"}
    Hk, Hv, d = 1, 2, 32
    gating = study.gating_params(Hv, torch.Generator().manual_seed(1))
    wanted = [p for p in study.policies() if p.name in ("float32", "tf32", "fla_bf16")]
    case = study.run_case(130, False, Hk, Hv, d, gating, seed=2, pols=wanted)
    error = {name: result["o32"]["mean_u"] for name, result in case["policies"].items()}
    assert error["float32"] < 1e-3 < error["tf32"] < error["fla_bf16"], error  # in bf16 ulps of o
