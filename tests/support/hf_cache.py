"""Build a real Hugging Face hub cache on disk, laid out exactly as huggingface_hub writes it.

```
models--ORG--NAME/
├── blobs/<sha256 of an LFS file | git blob sha1 of a small file>
├── refs/main                       the commit, with no trailing newline (huggingface_hub's own writes)
└── snapshots/<commit>/<name>  ->  ../../blobs/<hash>   (relative links, one more ../ per sub-directory)
```

Large files go in by hard link when the source is on the same file system, so the real Gemma GGUF costs no copy.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

__all__ = ["HfCacheBuilder", "git_blob_sha1", "sha256_file"]


def sha256_file(path: Path) -> str:
    """SHA-256 of a file, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def git_blob_sha1(data: bytes) -> str:
    """Git's blob id of `data` (what the hub's ETag is for a file not stored in LFS)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HfCacheBuilder:
    """Writes repositories into a hub cache directory.

    Args:
        root: the cache directory (`HF_HUB_CACHE`).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def repo_dir(self, repo_id: str) -> Path:
        """`models--ORG--NAME`."""
        return self.root / ("models--" + repo_id.replace("/", "--"))

    def add_file(
        self,
        repo_id: str,
        commit: str,
        name: str,
        *,
        source: Path | None = None,
        data: bytes | None = None,
        lfs: bool = True,
        sha256: str | None = None,
        copy: bool = False,
    ) -> Path:
        """Put one file into the snapshot of `commit`; returns its snapshot path.

        Args:
            source: a file to link (or copy) in; or `data`.
            lfs: name the blob by SHA-256 (an LFS file) rather than by git blob sha1.
            sha256: the known digest of `source` (spares hashing a large file).
            copy: write a plain file into the snapshot instead of a link (a cache huggingface_hub wrote without
                symlink support).
        """
        repo = self.repo_dir(repo_id)
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        snapshot = repo / "snapshots" / commit
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if data is None:
            assert source is not None
            blob_name = (sha256 or sha256_file(source)) if lfs else git_blob_sha1(source.read_bytes())
        else:
            blob_name = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
        if copy:
            if data is not None:
                target.write_bytes(data)
            else:
                assert source is not None
                shutil.copyfile(source, target)
            return target
        blob = repo / "blobs" / blob_name
        if not blob.exists():
            if data is not None:
                blob.write_bytes(data)
            else:
                assert source is not None
                try:
                    os.link(source, blob)
                except OSError:
                    shutil.copyfile(source, blob)
        depth = name.count("/")
        target.symlink_to(Path("../" * (2 + depth)) / "blobs" / blob_name)
        return target

    def set_ref(self, repo_id: str, ref: str, commit: str) -> None:
        """Point a branch or tag at a commit (no trailing newline, as huggingface_hub writes it)."""
        path = self.repo_dir(repo_id) / "refs" / ref
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(commit)
