"""A Hugging Face cache laid out as the hub lays it out, for the hub-id tests (no network).

A module of its own, not conftest.py: `from conftest import ...` finds whichever conftest.py pytest
imported first under that name (tests/kernels/ has one too), so the names would not resolve in a
full run.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


# A Hugging Face cache holding the example model as the hub lays it out (huggingface_hub's
# file_download.py): models--ORG--NAME/{blobs/SHA256, snapshots/COMMIT/FILE -> ../../blobs/SHA256,
# refs/BRANCH holding the commit}. Two commits: COMMIT_MAIN is the example model (refs/main),
# COMMIT_V2 the same files with other weights (refs/v2). Tests point HF_HUB_CACHE at it, offline.
HUB_ID = "rollout-test/tiny"
COMMIT_MAIN = "1" * 32 + "a1b2c3d4"
COMMIT_V2 = "2" * 32 + "e5f6a7b8"


def _hub_snapshot(repo: Path, commit: str, files: dict[str, bytes]) -> Path:
    import hashlib

    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / digest).write_bytes(data)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snapshot


def make_hub_cache(root: Path) -> dict:
    """The cache under `root` (HF_HUB_CACHE); returns its paths and commits."""
    from safetensors.torch import load_file, save_file

    model = REPO_ROOT / "recipes" / "example_model"
    files = {p.name: p.read_bytes() for p in sorted(model.iterdir()) if p.is_file()}
    tensors = load_file(str(model / "model.safetensors"))
    # other weights of the same shapes, as a fine-tune pushed as a new commit
    other = {name: (t * 1.5 if t.is_floating_point() else t).contiguous() for name, t in tensors.items()}
    save_file(other, str(root / "v2.safetensors"), metadata={"format": "pt"})
    repo = root / ("models--" + HUB_ID.replace("/", "--"))
    snapshots = {
        COMMIT_MAIN: _hub_snapshot(repo, COMMIT_MAIN, files),
        COMMIT_V2: _hub_snapshot(repo, COMMIT_V2, dict(files, **{"model.safetensors":
                                                                 (root / "v2.safetensors").read_bytes()})),
    }
    (root / "v2.safetensors").unlink()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT_MAIN)  # no newline: huggingface_hub writes none
    (repo / "refs" / "v2").write_text(COMMIT_V2)
    return {"cache": root, "hub_id": HUB_ID, "main": COMMIT_MAIN, "v2": COMMIT_V2, "snapshots": snapshots}
