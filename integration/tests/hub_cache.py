"""A Hugging Face Hub cache written by hand, in huggingface_hub's documented layout, so Hub ids
resolve offline in tests: under ``HF_HUB_CACHE``, ``models--ORG--NAME`` (or ``datasets--...``)
holds ``blobs/<sha256>`` (each file's bytes once), ``snapshots/<commit>/<path>`` (relative
symlinks to the blobs) and ``refs/<branch>`` (the commit the branch names)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_repo(
    cache: Path,
    repo_id: str,
    folder: Path,
    *,
    kind: str = "model",
    refs: tuple[str, ...] = ("main",),
) -> str:
    """``folder``'s files as the cache holds repository ``repo_id`` at one commit (named by the
    files' contents), ``refs`` naming it; the commit."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    digest = hashlib.sha1(repo_id.encode())
    for file in files:
        digest.update(str(file.relative_to(folder)).encode() + file.read_bytes())
    commit = digest.hexdigest()
    root = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    for file in files:
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / commit / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return commit
