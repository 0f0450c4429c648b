"""Every tuned fused-MoE launch-config file shipped in kernels/configs/fused_moe parses and is found
by its shape (a malformed file would silently fall back to the default config at run time)."""

import torch

from rollout_kernels.fused_moe_config import CONFIG_DIR, load_configs


def test_shipped_config_files_load_by_their_shape():
    files = sorted(CONFIG_DIR.glob("*.json"))
    assert files, f"no tuned configs in {CONFIG_DIR}"
    for path in files:
        fields = dict(part.split("=") for part in path.stem.split(","))
        dtype = getattr(torch, fields["dtype"])
        configs = load_configs(int(fields["E"]), int(fields["N"]), int(fields["K"]), dtype)
        assert configs, path
        assert all(cfg["BLOCK_SIZE_M"] in (16, 32, 64, 128) for cfg in configs.values()), path
