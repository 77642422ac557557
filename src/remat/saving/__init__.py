"""Saving and loading a folder as one transaction; it knows files, not models. One job per
file, data flowing down:

- `files`: atomic writes (with the umask's permissions), strict JSON reads, fingerprints.
- `locks`: file locks from `filelock` on descriptors remat opens itself (no symlink followed).
- `folder`: the folder transaction (staging, lock, commit, recovery) with the one save
  (`save_pair`) and the one load (`read_pair`).
- `stale_shards`: transformers' clean-up of an earlier save's weight shards, for a staged save.

This package imports nothing else of remat. What the pair holds, and how a model is saved into
it and loaded from it, is `remat.persistence`, above it.
"""

from .files import sha256_file
from .folder import STAGING_PREFIX

__all__ = ["STAGING_PREFIX", "sha256_file"]
