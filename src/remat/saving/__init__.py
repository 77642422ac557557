"""Saving and loading a folder as one transaction; files, not models. `files`: files opened
safely (atomic writes, strict JSON reads, fingerprints) and locks on them; `folder`: the
transaction, with the one save (`save_pair`) and the one load (`read_pair`). It imports only
`remat.errors`; `remat.persistence`, above it, is what a model's save holds.
"""

from .files import sha256_file
from .folder import STAGING_PREFIX

__all__ = ["STAGING_PREFIX", "sha256_file"]
