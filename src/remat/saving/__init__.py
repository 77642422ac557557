"""Saving and loading a folder as one transaction; files, not models. `files`: safe file access and
locks; `folder`: the transaction (`save_pair`, `read_pair`). It imports only `remat.errors`."""

from .files import sha256_file
from .folder import STAGING_PREFIX

__all__ = ["STAGING_PREFIX", "sha256_file"]
