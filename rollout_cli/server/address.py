"""Where the daemon listens, shared by `rollout serve` and the client commands (no heavy imports)."""

from __future__ import annotations

import getpass
import os
import socket
import stat

ENV_ENGINE = "ROLLOUT_ENGINE"

# The largest request body the daemon reads (serve --max-request-bytes). The largest legitimate
# body is an /update_weights_from_tensor of unbucketed tensors: it carries handles, not data,
# ~350 bytes of base64 per CUDA tensor, so 64 MiB holds ~190,000 of them, twice the ~93,000
# per-expert tensors of the largest MoE checkpoint we load (Qwen3.5-397B-A17B: 60 layers x 512
# experts x 3).
DEFAULT_MAX_REQUEST_BYTES = 64 * 2**20


def default_socket_path() -> str:
    """$XDG_RUNTIME_DIR/rollout.sock (a per-user 0700 directory) when set, else /tmp/rollout-$USER.sock."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "rollout.sock")
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry (containers): fall back to the uid
        user = str(os.getuid())
    return f"/tmp/rollout-{user}.sock"


def is_tcp(address: str) -> bool:
    return address.startswith(("http://", "https://"))


def socket_is_live(path: str) -> bool:
    """True when something accepts connections on the Unix socket at `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return False
    finally:
        probe.close()


def is_socket_file(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except FileNotFoundError:
        return False
